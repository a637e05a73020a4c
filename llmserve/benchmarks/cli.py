"""``llmserve bench {throughput,serve,sweep}``: flags and entry points.

llmserve bench throughput --workload text2sql --num-prompts 64 [--backend all]
llmserve bench serve --base-url http://127.0.0.1:8000 --request-rate 4
llmserve bench sweep --batch-sizes 1,2,4,8 --request-rates 1,4,inf --output-dir out/
llmserve bench latency --quantization gguf --peer llama.cpp
llmserve bench kernels
"""

from __future__ import annotations

import argparse
import json

from llmserve.benchmarks import workloads
from llmserve.benchmarks.throughput import BACKENDS
from llmserve.entrypoints.engine_args import add_engine_args, engine_kwargs


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers (or inf), got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_workload_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=workloads.WORKLOADS,
        default="text2sql",
        help="built-in workload (default: text2sql)",
    )
    g.add_argument(
        "--dataset",
        metavar="FILE",
        help='JSONL file, one {"prompt": ..., "output_len": ...} per line (replaces --workload)',
    )
    g.add_argument(
        "--num-prompts", type=int, default=num_prompts, help=f"requests (default: {num_prompts})"
    )
    g.add_argument(
        "--input-len", type=int, default=128, help="random workload: prompt tokens (default: 128)"
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens of every request (default: text2sql 64, random 128, "
        "chat log-normal median 100, dataset: its output_len or 128)",
    )
    g.add_argument(
        "--dataset-seed",
        type=int,
        default=0,
        help="seed of the workload generator and of Poisson arrivals (default: 0)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0)"
    )
    g.add_argument("--output-json", metavar="FILE", help="write the results to this JSON file")
    g.add_argument(
        "--save-prompt-ids",
        metavar="FILE",
        help="also write the prompts' token ids (a JSON list of lists), for a peer that runs "
        "the same ids (benchmarks/vllm_cpu_peer.py offline --prompts FILE)",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def _make_requests(args: argparse.Namespace):
    def make(tokenizer) -> list[workloads.BenchRequest]:
        requests = workloads.make_requests(
            tokenizer,
            args.workload,
            args.num_prompts,
            args.dataset_seed,
            args.output_len,
            args.input_len,
            args.dataset,
        )
        if getattr(args, "save_prompt_ids", None):
            with open(args.save_prompt_ids, "w") as f:
                json.dump([r.prompt_token_ids for r in requests], f)
        return requests

    return make


# ---- throughput -----------------------------------------------------------------------------
def add_throughput_parser(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput, all requests at once")
    add_workload_args(p, num_prompts=100)
    g = p.add_argument_group("backends")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="llmserve",
        help="llmserve, a peer (transformers, llama-cpp) or all (default: llmserve)",
    )
    g.add_argument(
        "--hf-batch-size", type=int, default=32, help="transformers static batch size (default: 32)"
    )
    g.add_argument(
        "--hf-continuous",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run transformers' continuous batching when it exists (default: on)",
    )
    g.add_argument(
        "--lora-path",
        default=None,
        help="every request with this PEFT LoRA adapter (as --max-loras adapters of ids 1..N, "
        "round robin, as vLLM's benchmark); llmserve only, turns on --enable-lora",
    )
    add_engine_args(p)
    p.set_defaults(func=run_throughput_command)


def run_throughput_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.throughput import run_throughput

    report = run_throughput(args, engine_kwargs(args), _make_requests(args))
    return 0 if report["results"] else 1


# ---- serve ----------------------------------------------------------------------------------
def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="latency and throughput of a running server")
    add_workload_args(p, num_prompts=100)
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)"
    )
    g.add_argument(
        "--model",
        default=None,
        help="model whose tokenizer builds the workload (default: the default model)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help='"model" field of the requests (default: first of /v1/models)',
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s; inf sends all at once (default: inf)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.set_defaults(func=run_serve_command)


def run_serve_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.report import machine_info, write_json
    from llmserve.benchmarks.serve_client import run_serve_benchmark, serve_summary_text
    from llmserve.benchmarks.throughput import describe_requests
    from llmserve.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.model)
    requests = _make_requests(args)(tokenizer)
    print(describe_requests(requests))
    result = run_serve_benchmark(
        args.base_url,
        args.served_model_name,
        requests,
        tokenizer,
        args.request_rate,
        args.max_concurrency,
        args.temperature,
        args.dataset_seed,
        not args.disable_tqdm,
    )
    result |= {
        "workload": args.dataset or args.workload,
        "num_prompts": len(requests),
        "machine": machine_info(),
    }
    print(serve_summary_text(result))
    write_json(args.output_json, result)
    return 0 if result["completed"] else 1


# ---- sweep ----------------------------------------------------------------------------------
def add_sweep_parser(subparsers) -> None:
    from llmserve.benchmarks.sweep import DEFAULT_BATCH_SIZES, DEFAULT_REQUEST_RATES, STRATEGIES

    p = subparsers.add_parser(
        "sweep", help="throughput vs batch size, latency vs request rate (plots)"
    )
    add_workload_args(p, num_prompts=128)
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--batch-sizes",
        type=_ints,
        default=list(DEFAULT_BATCH_SIZES),
        help="max_num_seqs values, comma-separated; empty skips (default: 1,2,...,64)",
    )
    g.add_argument(
        "--request-rates",
        type=_floats,
        default=list(DEFAULT_REQUEST_RATES),
        help="Poisson rates (req/s, inf allowed); empty skips (default: 1,2,4,8,16,32)",
    )
    g.add_argument(
        "--strategies",
        type=_names,
        default=list(STRATEGIES),
        help="batching strategies for the rate sweep (default: continuous,dynamic,static)",
    )
    g.add_argument(
        "--output-dir",
        default="bench_results/sweep",
        help="where sweep.json and the PNG plots go (default: %(default)s)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_sweep_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.sweep import SweepPlan, run_sweep
    from llmserve.tokenizer import get_tokenizer

    plan = SweepPlan(
        args.batch_sizes,
        args.request_rates,
        args.strategies,
        args.temperature,
        args.dataset_seed,
        not args.disable_tqdm,
    )
    requests = _make_requests(args)(get_tokenizer(args.model))
    run_sweep(
        plan,
        engine_kwargs(args),
        requests,
        args.output_dir,
        args.output_json,
        args.dataset or args.workload,
    )
    return 0


# ---- report ---------------------------------------------------------------------------------
def add_report_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="print saved --output-json files as Markdown tables")
    p.add_argument("files", nargs="+", metavar="FILE.json")
    p.add_argument(
        "--relative-to", metavar="DIR", help="write plot links relative to this folder (e.g. docs)"
    )
    p.set_defaults(func=run_report_command)


def run_report_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.markdown import render_files

    print(render_files(args.files, args.relative_to))
    return 0


# ---- attention --------------------------------------------------------------------------
def add_attention_parser(subparsers) -> None:
    from llmserve.benchmarks.attention import add_arguments

    p = subparsers.add_parser(
        "attention",
        help="attention vs matmul step breakdown, paged vs contiguous (CPU; GPU kernels on CUDA)",
    )
    add_arguments(p)
    p.set_defaults(func=run_attention_command)


def run_attention_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks import attention

    attention.run(args)
    return 0


# ---- latency --------------------------------------------------------------------------------
def add_latency_parser(subparsers) -> None:
    from llmserve.benchmarks.latency import add_arguments

    p = subparsers.add_parser(
        "latency", help="one request alone: TTFT and batch-1 decode tok/s (--peer llama.cpp)"
    )
    add_arguments(p)
    p.set_defaults(func=run_latency_command)


def run_latency_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks import latency

    report = latency.run(args)
    return 0 if report["results"] else 1


# ---- kernels --------------------------------------------------------------------------------
def add_kernels_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels", help="quantized matmul kernels vs fp32 and torch's int8/int4 baselines (CPU)"
    )
    p.add_argument("--isa", default="auto", help="CPU kernel path: auto, avx512_vnni, avx2, scalar")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per shape (default: 20)")
    p.add_argument("--output-json", metavar="FILE", help="write the results to this JSON file")
    p.set_defaults(func=run_kernels_command)


def run_kernels_command(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.kernels import format_table, run_kernel_benchmark
    from llmserve.benchmarks.report import machine_info, write_json

    rows = run_kernel_benchmark(repeats=args.repeats, isa=args.isa)
    print(format_table(rows))
    write_json(args.output_json, {"results": rows, "machine": machine_info()})
    return 0


def add_parser(subparsers) -> None:
    """Register ``bench`` and its subcommands on the ``llmserve`` parser."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: throughput, serve, sweep, report, attention, latency, kernels"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(sub)
    add_serve_parser(sub)
    add_sweep_parser(sub)
    add_report_parser(sub)
    add_attention_parser(sub)
    add_latency_parser(sub)
    add_kernels_parser(sub)
