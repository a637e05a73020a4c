"""``llmserve bench latency``: one request, alone on the machine: time to first token and
decode speed (batch 1), optionally beside llama.cpp on the same GGUF file in the same run.

    llmserve bench latency --quantization gguf --output-len 256 --peer llama.cpp

The prompt is the first text2sql prompt (``--dataset-seed``); EOS is ignored so every run
decodes exactly ``--output-len`` tokens. Each backend runs ``--num-iters`` times after a
warm-up; the median run is reported.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from llmserve.benchmarks import workloads
from llmserve.benchmarks.engine_run import spec_text
from llmserve.benchmarks.report import format_table, machine_info, machine_text, write_json
from llmserve.entrypoints.engine_args import add_engine_args, engine_kwargs

PEERS = ("llama.cpp",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("latency")
    g.add_argument("--output-len", type=int, default=256, help="tokens to decode (default: 256)")
    g.add_argument("--num-iters", type=int, default=3, help="measured runs (default: 3)")
    g.add_argument(
        "--workload", choices=("text2sql", "chat"), default="text2sql", help="prompt kind"
    )
    g.add_argument("--dataset-seed", type=int, default=0, help="which prompt (default: 0)")
    g.add_argument(
        "--peer", choices=PEERS, action="append", default=[], help="also run this peer (repeatable)"
    )
    g.add_argument("--output-json", metavar="FILE", help="write the results to this JSON file")
    add_engine_args(p)


def decode_result(name: str, ttft: float, total: float, num_tokens: int) -> dict[str, Any]:
    """TTFT, and decode speed over the tokens after the first."""
    decode_time = max(total - ttft, 1e-9)
    return {
        "backend": name,
        "ttft_ms": ttft * 1e3,
        "decode_tok_s": (num_tokens - 1) / decode_time,
        "tpot_ms": decode_time / max(num_tokens - 1, 1) * 1e3,
        "num_tokens": num_tokens,
    }


def run_llmserve_once(engine, prompt_ids: list[int], output_len: int) -> dict[str, Any]:
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
    first = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens = len(out.outputs[0].token_ids)
            if first is None and num_tokens:
                first = time.perf_counter() - start
    return decode_result("llmserve", first or 0.0, time.perf_counter() - start, num_tokens)


def run_llama_cpp_once(llm, prompt_ids: list[int], output_len: int, banned: list[int]):
    import llama_cpp

    from llmserve.benchmarks.peers import ban_tokens

    start = time.perf_counter()
    first = None
    num_tokens = 0
    stream = llm.create_completion(
        prompt=prompt_ids, max_tokens=output_len, temperature=0.0, top_k=1, stream=True,
        repeat_penalty=1.0, logits_processor=ban_tokens(llama_cpp, banned),
    )  # fmt: skip
    for _ in stream:
        num_tokens += 1
        if first is None:
            first = time.perf_counter() - start
    return decode_result("llama.cpp", first or 0.0, time.perf_counter() - start, num_tokens)


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
    return best | {"decode_tok_s_runs": [round(r["decode_tok_s"], 1) for r in runs]}


def bench_llmserve(kwargs: dict[str, Any], prompt_ids, output_len, num_iters) -> dict[str, Any]:
    from llmserve.benchmarks.engine_run import build_engine, engine_counters, spec_report

    engine, load_s = build_engine(kwargs)
    with engine.compute_threads_bound():  # as LLM.generate and the server step
        run_llmserve_once(engine, prompt_ids, 8)  # warm-up at this prompt length
        before = engine_counters(engine)
        runs = [run_llmserve_once(engine, prompt_ids, output_len) for _ in range(num_iters)]
        after = engine_counters(engine)
    result = _median(runs)
    result |= spec_report({k: after[k] - before[k] for k in after})
    result |= {"load_s": load_s, "quantization": kwargs.get("quantization"), "info": engine.kv_info}
    del engine
    return result


def bench_llama_cpp(model, prompt_ids, output_len, num_iters, eos_ids) -> dict[str, Any]:
    from llmserve.benchmarks.peers import load_llama_cpp

    _, llm = load_llama_cpp(model, "cpu", len(prompt_ids) + output_len + 8)
    banned = sorted(eos_ids | {llm.token_eos()})
    run_llama_cpp_once(llm, prompt_ids, 8, banned)
    runs = [run_llama_cpp_once(llm, prompt_ids, output_len, banned) for _ in range(num_iters)]
    return _median(runs) | {"n_threads": llm.n_threads}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from llmserve.benchmarks.peers import BackendUnavailable
    from llmserve.kernels.cpu.quant import auto_isa
    from llmserve.tokenizer import get_tokenizer

    kwargs = engine_kwargs(args)
    tokenizer = get_tokenizer(kwargs.get("model"))
    make = workloads.chat_requests if args.workload == "chat" else workloads.text2sql_requests
    request = make(tokenizer, 1, args.dataset_seed, args.output_len)[0]
    results = [bench_llmserve(kwargs, request.prompt_token_ids, args.output_len, args.num_iters)]
    for peer in args.peer:
        try:
            eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            results.append(
                bench_llama_cpp(
                    kwargs.get("model"), request.prompt_token_ids, args.output_len,
                    args.num_iters, eos,
                )
            )  # fmt: skip
        except BackendUnavailable as exc:
            print(f"{peer}: skipped ({exc})")
    report = {
        "workload": args.workload,
        "prompt_len": request.prompt_len,
        "output_len": args.output_len,
        "results": results,
        "machine": machine_info() | {"cpu_kernel_isa": auto_isa()},
    }
    print(summary_text(report))
    write_json(args.output_json, report)
    return report


def summary_text(report: dict[str, Any]) -> str:
    rows = [
        (r["backend"] + (f" ({r['quantization']})" if r.get("quantization") else ""),
         r["ttft_ms"], r["decode_tok_s"], r["tpot_ms"], " ".join(map(str, r["decode_tok_s_runs"])))
        for r in report["results"]
    ]  # fmt: skip
    table = format_table(("backend", "TTFT ms", "decode tok/s", "TPOT ms", "runs tok/s"), rows)
    header = (
        f"one {report.get('workload', 'text2sql')} request: {report['prompt_len']} prompt tokens, {report['output_len']} output tokens; "
        f"{machine_text(report['machine'])}; CPU kernels: {report['machine']['cpu_kernel_isa']}"
    )
    spec = [spec_text(r) for r in report["results"] if "spec_num_drafts" in r]
    return header + "\n" + table + "".join("\n" + line for line in spec)
