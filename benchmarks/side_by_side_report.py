"""side_by_side.py's reading of its results: issue 17's targets per round, their medians over
the rounds, and summary.md's table (also ``side_by_side.py --summarize`` on a saved folder)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LONG_PROMPT = 1024  # tokens a prompt in the long-context run (a quarter as many requests)
CLIENTS = {"vclient-inf": "vLLM's client", "lclient-inf": "llmserve's client"}  # all at once


def batch1_tok_s(latency: dict) -> float:
    """llmserve's batch-1 rate with the prefill counted, as vLLM's offline script counts it."""
    r = latency["results"][0]
    seconds = r["ttft_ms"] / 1e3 + (r["num_tokens"] - 1) * r["tpot_ms"] / 1e3
    return r["num_tokens"] / seconds


def preload_of(one: dict) -> str:
    """What vLLM ran with in LD_PRELOAD in a round (the line vllm_cpu_peer.py prints)."""
    preload = one.get("vllm_preload")
    return "not recorded" if preload is None else preload or "none"


def rounds_of(results: dict) -> list[dict]:
    """The rounds of a results.json; a folder from before rounds (one flat round) is one."""
    return results["rounds"] if "rounds" in results else [results]


def round_targets(one: dict) -> list[tuple[str, float, float, str]]:
    """(what, llmserve, vLLM, target) for each of issue 17's targets in one round; vLLM's
    figure is NaN where the target is a ratio of llmserve's own figures (server / offline)."""
    ours, theirs = one["llmserve_server"], one["vllm_server"]
    rows = []
    for client, who in CLIENTS.items():
        a, b = ours[client]["output_throughput"], theirs[client]["output_throughput"]
        rows.append((f"all at once, output tok/s ({who})", a, b, ">= 1.2x"))
    a, b = ours["vclient-4"]["mean_tpot_ms"], theirs["vclient-4"]["mean_tpot_ms"]
    rows.append(("4 requests/s, mean TPOT ms", a, b, "below"))
    a = one["off-t2s"]["results"][0]["output_throughput"]
    b = max(one["vllm_offline"]["text2sql_cold"])
    rows.append(("text2sql offline, output tok/s", a, b, ">= 1.2x"))
    a = batch1_tok_s(one["off-latency"])
    b = statistics.median(one["vllm_offline"]["batch1"])
    rows.append(("batch 1, 256 tokens, tok/s", a, b, "not below"))
    if "vclient-long" in ours and "vclient-long" in theirs:  # runs before it had none
        long_ours, long_theirs = ours["vclient-long"], theirs["vclient-long"]
        a, b = long_ours["output_throughput"], long_theirs["output_throughput"]
        prompts = long_ours.get("num_prompts", "")
        rows.append((f"long prompts ({LONG_PROMPT}/128 x {prompts}) at once, output tok/s", a, b,
                     "(none)"))  # fmt: skip
    offline = one["off-random"]["results"][0]["output_throughput"]
    for client, who in CLIENTS.items():
        ratio = ours[client]["output_throughput"] / offline
        rows.append((f"server / offline ({who})", ratio, float("nan"), ">= 0.95"))
    if one.get("svo_pairs"):  # runs before 2026-11-30 had none
        ratio = statistics.median(p["ratio"] for p in one["svo_pairs"])
        rows.append(("server / offline, back to back (llmserve's client)", ratio, float("nan"),
                     ">= 0.95"))  # fmt: skip
    return rows


def meets(target: str, ratio: float) -> bool | None:
    """Whether a ratio (llmserve / vLLM, or server / offline) meets a target; None: no target."""
    return {">= 1.2x": ratio >= 1.2, "below": ratio < 1.0, "not below": ratio >= 1.0,
            ">= 0.95": ratio >= 0.95}.get(target)  # fmt: skip


@dataclass
class Row:
    """One target over the rounds: medians of each engine's figure and of the rounds' ratios."""

    what: str
    ours: float
    theirs: float  # NaN: the target is llmserve's own ratio
    target: str
    ratios: list[float]  # per round: llmserve / vLLM, or the server / offline ratio itself

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def met(self) -> bool | None:
        return meets(self.target, self.ratio)


def targets(results: dict) -> list[Row]:
    """Issue 17's targets over all rounds (a row only where every round has it)."""
    per_round = [{row[0]: row for row in round_targets(one)} for one in rounds_of(results)]
    rows = []
    for what, *_, target in per_round[0].values():
        if not all(what in one for one in per_round):
            continue
        ours, theirs = [one[what][1] for one in per_round], [one[what][2] for one in per_round]
        own = math.isnan(theirs[0])  # llmserve's own ratio
        ratios = ours if own else [a / b for a, b in zip(ours, theirs)]
        rows.append(Row(what, statistics.median(ours), statistics.median(theirs), target, ratios))
    return rows


def paired_note(rounds: list[dict]) -> list[str]:
    """A line on how --paired ran (none for a run of one server at a time)."""
    idle = [s for one in rounds for s in one.get("paired_idle_cpu_s", {}).values()]
    if not idle:
        return []
    waited = [s for one in rounds for s in one.get("paired_quiet_wait_s", [])]
    quiet = (f", each run started once both were quiet (waited {statistics.median(waited):.1f} s,"
             f" median; at most {max(waited):.1f})" if waited else "")  # fmt: skip
    return [f"servers paired (--paired): both up throughout, each client run on both back to "
            f"back{quiet}; the idle server used {statistics.median(idle):.2f} CPU s during a "
            f"run of the other (median; at most {max(idle):.2f})"]  # fmt: skip


def env_text(settings: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "none (the defaults)"


def summary(results: dict) -> str:
    host = results["host"]
    count = len(rounds_of(results))
    lines = [
        f"{results['dtype']} on {host.get('cpu', '?')} ({host.get('cpus')} CPUs; flags "
        f"{' '.join(host.get('flags', []))}), commit {host['commit']}, {host['time_utc']} UTC, "
        f"{count} round{'s' if count > 1 else ''} (medians; the rounds' own ratios at the end)",
        f"vLLM's LD_PRELOAD: {preload_of(rounds_of(results)[0])}",
        f"llmserve's LLMSERVE_CPU_* settings: {env_text(host.get('llmserve_cpu_env'))}",
        *paired_note(rounds_of(results)),
        "",
        "| | llmserve | vLLM-CPU | ratio | target | met | per round |",
        "| --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for row in targets(results):
        own = math.isnan(row.theirs)
        ratio = "" if own else f"{row.ratio:.2f}"
        other = "" if own else f"{row.theirs:.1f}"
        met = "" if row.met is None else "yes" if row.met else "NO"
        each = " / ".join(f"{r:.2f}" for r in row.ratios)
        lines.append(
            f"| {row.what} | {row.ours:.2f} | {other} | {ratio} | {row.target} | {met} | {each} |"
        )
    return "\n".join(lines) + "\n"
