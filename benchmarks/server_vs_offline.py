"""llmserve's server against its own offline engine, back to back: issue 17's "server within
5% of offline" without vLLM, in pairs close enough that the VM's drift falls on both halves.

Run with llmserve's Python, from the repository root, on an idle machine (about 2 minutes a
pair on 2 cores with the defaults):

    python benchmarks/server_vs_offline.py --dtype bfloat16 --pairs 3 --out /tmp/svo-bf16

A pair: the offline random batch (``llmserve bench throughput``, 64 x 256/128), then a fresh
server (``llmserve serve``) with llmserve's client sending the same prompts all at once
(``llmserve bench serve --request-rate inf``), the server closed after. Each pair has prompts
of its own (a seed per pair), so no pair finds an earlier one's in a prefix cache; both halves
get the same 1 GiB of KV cache as benchmarks/side_by_side.py gives. Printed: each pair's
output tok/s and ratio, and the median ratio against the target (>= 0.95). The side by side's
server / offline figure is one such pair per round and client, minutes apart; on an Intel VM
its pairs read 0.90-1.15 where pairs back to back read 0.95-1.12 (docs/bench/journal.md).
Every command's output is kept in --out, with results.json.

Where the server's CPU goes during the client's run, per pair: the server's main thread (its
event loop: HTTP, SSE, the outputs turned into chunks), the whole server process (the engine
thread and the compute threads, which spin while they wait, so count busy), and the client
process (start-up, tokenizing its prompts, reading the streams). Beside them, the offline
run's whole process (start-up and model load included) and the VM's steal time during each
half (/proc/stat): a pair whose halves differ and whose steal differs with them measures the
VM, not the server. ``--stream-interval N``
starts the servers with it (vLLM's flag: N new tokens in each streamed chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_processes import (  # noqa: E402
    Server,
    group_cpu_s,
    llmserve_client_cli,
    llmserve_server_cli,
    offline_cli,
    random_batch_flags,
    run,
    steal_s,
    thread_cpu_s,
)

TARGET = 0.95


def pair(args: argparse.Namespace, pair_no: int, out: Path) -> dict:
    """One pair's output tok/s: offline first, then the server on the same prompts."""
    batch = random_batch_flags(args.num_prompts, 100 + pair_no, args.input_len, args.output_len)
    offline_json, server_json = out / f"offline-{pair_no}.json", out / f"client-{pair_no}.json"
    offline0, steal0 = _children_cpu_s(), steal_s()
    run(offline_cli(args.dtype, batch, offline_json), out / f"offline-{pair_no}.txt")
    offline_half = {"offline_cpu_s": _children_cpu_s() - offline0,
                   "offline_steal_s": steal_s() - steal0}  # fmt: skip
    log = out / f"server-{pair_no}.txt"
    server_cmd = llmserve_server_cli(args.dtype, args.port)
    server_cmd += ["--stream-interval", str(args.stream_interval)]
    with Server(server_cmd, log, args.port) as server:
        pid = server.pgid  # the server's process (its main thread has the same id)
        http0, server0 = thread_cpu_s(pid, pid), group_cpu_s(pid)
        client0, steal0 = _children_cpu_s(), steal_s()
        run(llmserve_client_cli(server.url, batch, server_json), out / f"client-{pair_no}.txt")
        cpu = {
            "http_cpu_s": thread_cpu_s(pid, pid) - http0,
            "server_cpu_s": group_cpu_s(pid) - server0,
            "client_cpu_s": _children_cpu_s() - client0,
            "server_steal_s": steal_s() - steal0,
            **offline_half,
        }
    offline = json.loads(offline_json.read_text())["results"][0]["output_throughput"]
    served = json.loads(server_json.read_text())["output_throughput"]
    return {"pair": pair_no, "offline": offline, "server": served, "ratio": served / offline,
            **cpu}  # fmt: skip


def _children_cpu_s() -> float:
    """CPU seconds this script's ended children have used (the client, once it has ended)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(pairs: list[dict], dtype: str) -> str:
    lines = [f"{dtype}: server / offline, {len(pairs)} pairs back to back", "",
             "| pair | offline tok/s | server tok/s | server / offline | CPU s: HTTP thread / "
             "server / client | offline run's CPU s | steal s: offline / server |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for p in pairs:
        cpu = f"{p['http_cpu_s']:.2f} / {p['server_cpu_s']:.1f} / {p['client_cpu_s']:.1f}"
        steal = f"{p['offline_steal_s']:.1f} / {p['server_steal_s']:.1f}"
        lines.append(f"| {p['pair']} | {p['offline']:.1f} | {p['server']:.1f} | "
                     f"{p['ratio']:.3f} | {cpu} | {p['offline_cpu_s']:.1f} | {steal} |")  # fmt: skip
    median = statistics.median(p["ratio"] for p in pairs)
    verdict = "met" if median >= TARGET else "NOT met"
    lines += ["", f"median {median:.3f} (target >= {TARGET}: {verdict})"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options (side_by_side.py builds its pairs' from them too)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", required=True, help="folder for every output and results.json")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--stream-interval", type=int, default=1, help="the servers' (default 1)")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs must be at least 1, got {args.pairs}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pairs = []
    for pair_no in range(1, args.pairs + 1):
        pairs.append(pair(args, pair_no, out))
        (out / "results.json").write_text(json.dumps({"dtype": args.dtype, "pairs": pairs}))
    print(summary(pairs, args.dtype), end="")


if __name__ == "__main__":
    main()
