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
With --paired both servers stay up through a round's client runs and each run goes to both
back to back, the first engine alternating run by run (the four parts become three): an
engine's figure and its peer's are then a minute apart instead of a server's whole turn
(6-12 minutes, over which this VM's speed has moved 10-20%). Each run starts once both
servers have been quiet for a second (vLLM's still used a core for a second or two after its
own runs); the CPU time the idle server takes meanwhile is recorded and printed.
Each round ends with --svo-pairs (default 1) of benchmarks/server_vs_offline.py's pairs: the
offline random batch, then at once a fresh llmserve server with llmserve's client on the same
prompts, back to back; their ratio is the table's "server / offline, back to back" row, the
measure of that target least moved by the VM's drift (the other two rows divide runs minutes
apart).
Every command's output is kept in --out/rN, with host.json (CPU flags, commit) and summary.md,
the table printed at the end: each figure is the median over rounds, each ratio the median of
the rounds' own ratios, and a target is met when that ratio meets it:

    all at once, output tok/s    >= 1.2x vLLM's, with each client
    4 requests/s, mean TPOT      below vLLM's
    text2sql offline, tok/s      >= 1.2x vLLM's best cold run
    batch 1, tok/s               not below vLLM's (medians of three, prefill included)
    server / offline             >= 0.95 (llmserve's server at once, either client, against
                                 the offline random 256/128 batch of the same round; and
                                 the back-to-back pairs above)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import server_vs_offline  # noqa: E402
import side_by_side_report as report  # noqa: E402
from bench_processes import (  # noqa: E402
    KV_BYTES,
    NAME,
    ROOT,
    Server,
    group_cpu_s,
    llmserve_cli,
    llmserve_client_cli,
    llmserve_server_cli,
    offline_cli,
    random_batch_flags,
    run,
    wait_until_quiet,
)

PEER = ROOT / "benchmarks" / "vllm_cpu_peer.py"
QUIET_WINDOW_S = 1.0  # --paired: a server counts as idle after this long under 5% of a core
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


LCLIENT_RUN = 3  # seed number of llmserve's client's run (vLLM's: 0-2) and of the offline random


def in_round_order(round_no: int, items: list) -> list:
    """``items`` as given in odd rounds, reversed in even ones (each round's order of parts,
    clients and runs; see the module doc)."""
    return items if round_no % 2 else items[::-1]


def seed(round_no: int, run_no: int) -> int:
    """The prompt seed of a round's run: the same on both engines, new in every run."""
    return 10 * round_no + run_no


ClientRun = Callable[[str, str, dict], None]  # (server url, engine tag, results to fill)


def client_runs(args: argparse.Namespace, out: Path, round_no: int) -> dict[str, ClientRun]:
    """A round's four client runs on a server, by label: vLLM's client all at once
    ("vclient-inf"), llmserve's all at once ("lclient-inf"), vLLM's at 4 requests/s
    ("vclient-4") and at once on long prompts ("vclient-long"); each writes its JSON result
    under its label."""

    def vllm_client(run_no: int, label: str, rate: str, prompt_len: int, prompts: int):
        def client(url: str, tag: str, results: dict) -> None:
            name = f"{tag}-vclient-{label}.json"
            run([args.vllm_python, str(PEER), "bench", "serve", "--backend", "openai",
                 "--base-url", url, "--model", NAME, "--tokenizer", args.hf_dir,
                 "--dataset-name", "random", "--random-input-len", str(prompt_len),
                 "--random-output-len", "128", "--num-prompts", str(prompts), "--ignore-eos",
                 "--temperature", "0", "--request-rate", rate,
                 "--seed", str(seed(round_no, run_no)), "--save-result", "--result-dir",
                 str(out), "--result-filename", name], out / f"{tag}-vclient-{label}.txt")  # fmt: skip
            results[f"vclient-{label}"] = json.loads((out / name).read_text())

        return client

    def llmserve_client(url: str, tag: str, results: dict) -> None:
        name = f"{tag}-lclient-inf.json"
        batch = random_batch_flags(args.num_prompts, seed(round_no, LCLIENT_RUN))
        run(llmserve_client_cli(url, batch, out / name), out / f"{tag}-lclient-inf.txt")
        results["lclient-inf"] = json.loads((out / name).read_text())

    long_prompts = max(1, args.num_prompts // 4)
    return {
        "vclient-inf": vllm_client(0, "inf", "inf", 256, args.num_prompts),
        "lclient-inf": llmserve_client,
        "vclient-4": vllm_client(1, "4", "4", 256, args.num_prompts),
        "vclient-long": vllm_client(2, "long", "inf", report.LONG_PROMPT, long_prompts),
    }


def run_order(round_no: int) -> list[str]:
    """The client runs' labels in a round's order: the two all-at-once runs back to back
    (llmserve's client first in even rounds), after the other two in odd rounds and before
    them in even ones. The at-once pair sits side by side so that the VM's drift over a
    server's runs (minutes) falls on neither client, and next to llmserve's offline part,
    whose random batch it is compared with (server / offline)."""
    at_once = in_round_order(round_no, ["vclient-inf", "lclient-inf"])
    return [label for part in in_round_order(round_no, [["vclient-4", "vclient-long"], at_once])
            for label in part]  # fmt: skip


def clients(args: argparse.Namespace, url: str, tag: str, out: Path, round_no: int) -> dict:
    """The four client runs on one server, in run_order: their JSON results by label."""
    runs, results = client_runs(args, out, round_no), {}
    for label in run_order(round_no):
        runs[label](url, tag, results)
    return results


def paired_clients(
    args: argparse.Namespace, servers: dict[str, Server], out: Path, round_no: int
) -> tuple[dict[str, dict], dict[str, float], list[float]]:
    """--paired: each client run on both servers back to back (both up throughout), the engine
    that goes first alternating from run to run and round to round, so the VM's drift between
    two engines' figures is a minute's, not a server's whole turn. Each run starts once both
    servers are quiet (wait_until_quiet: the last run's server may still be finishing up).
    Returns each engine's results by label, the CPU seconds the idle server used during each
    of the other's runs (what it took from the run measured), and the seconds waited."""
    runs = client_runs(args, out, round_no)
    results: dict[str, dict] = {tag: {} for tag in servers}
    idle_cpu_s: dict[str, float] = {}
    waited_s: list[float] = []
    pgids = [server.pgid for server in servers.values()]
    for i, label in enumerate(run_order(round_no)):
        for tag in in_round_order(round_no + i, list(servers)):
            idle = next(server for other, server in servers.items() if other != tag)
            waited_s.append(round(wait_until_quiet(pgids, window_s=QUIET_WINDOW_S), 1))
            before = group_cpu_s(idle.pgid)
            runs[label](servers[tag].url, tag, results[tag])
            idle_cpu_s[f"{tag}-{label}"] = round(group_cpu_s(idle.pgid) - before, 2)
    return results, idle_cpu_s, waited_s


class Round:
    """One round's parts (four; three with --paired); ``parts()`` gives them in this round's
    order."""

    def __init__(self, args: argparse.Namespace, round_no: int, first_ids: Path) -> None:
        self.args, self.round_no = args, round_no
        self.out = Path(args.out) / f"r{round_no}"
        self.out.mkdir(parents=True, exist_ok=True)
        # text2sql prompts are the same every round: round 1's ids serve every later round,
        # so an even round can run vLLM offline first
        self.ids = first_ids
        self.results: dict = {"round": round_no}

    def parts(self) -> list:
        if self.args.paired:
            order = [self.servers_paired, self.llmserve_offline, self.vllm_offline]
        else:
            order = [self.vllm_server, self.llmserve_server, self.llmserve_offline,
                     self.vllm_offline]  # fmt: skip
        last = [self.server_offline_pairs] if self.args.svo_pairs else []
        return in_round_order(self.round_no, order) + last

    def server_offline_pairs(self) -> None:
        """--svo-pairs of server_vs_offline.py's back-to-back pairs (module doc), prompts of
        their own (seeds 100 + 10 x round + pair)."""
        a = self.args
        flags = ["--dtype", a.dtype, "--port", str(a.port), "--num-prompts", str(a.num_prompts),
                 "--out", str(self.out)]  # fmt: skip
        svo = server_vs_offline.parse_args(flags)  # the rest its defaults (256/128 tokens)
        self.results["svo_pairs"] = [
            server_vs_offline.pair(svo, 10 * self.round_no + i, self.out)
            for i in range(1, a.svo_pairs + 1)
        ]

    def start_vllm(self, port: int) -> Server:
        a = self.args
        return Server([a.vllm_python, str(PEER), "serve", a.hf_dir, "--dtype", a.dtype,
                       "--port", str(port), "--served-model-name", NAME],
                      self.out / "vllm-server.txt", port)  # fmt: skip

    def start_llmserve(self, port: int) -> Server:
        return Server(llmserve_server_cli(self.args.dtype, port),
                      self.out / "llmserve-server.txt", port)  # fmt: skip

    def vllm_server(self) -> None:
        self.one_server("vllm", self.start_vllm)

    def llmserve_server(self) -> None:
        self.one_server("llmserve", self.start_llmserve)

    def one_server(self, tag: str, start: Callable[[int], Server]) -> None:
        with start(self.args.port) as server:
            self.results[f"{tag}_server"] = clients(
                self.args, server.url, tag, self.out, self.round_no
            )

    def servers_paired(self) -> None:
        """--paired: both servers up (vLLM's on --port, llmserve's on the next), each client
        run on both back to back (paired_clients)."""
        with self.start_vllm(self.args.port) as vllm:
            with self.start_llmserve(self.args.port + 1) as ours:
                servers = {"vllm": vllm, "llmserve": ours}
                results, idle, waited = paired_clients(self.args, servers, self.out,
                                                       self.round_no)  # fmt: skip
        for tag, by_label in results.items():
            self.results[f"{tag}_server"] = by_label
        self.results["paired_idle_cpu_s"] = idle
        self.results["paired_quiet_wait_s"] = waited

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
    p.add_argument(
        "--paired",
        action="store_true",
        help="both servers up at once, each client run on both back to back (default: one "
        "server at a time, each with its four runs)",
    )
    p.add_argument(
        "--svo-pairs",
        type=int,
        default=1,
        help="server_vs_offline.py pairs at the end of each round (default 1; 0: none)",
    )
    p.add_argument("--summarize", action="store_true", help="only rebuild summary.md from --out")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.svo_pairs < 0:
        p.error(f"--svo-pairs must be 0 or more, got {args.svo_pairs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        results = json.loads((out / "results.json").read_text())
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        results = measure(args)
    text = report.summary(results)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
