"""``llmserve bench throughput``: offline, every request queued at once, for each backend.

requests (same token ids, same output lengths, EOS ignored)
  -> llmserve      in-process LLMEngine, stepped until all finish
  -> transformers  static generate batches, and its continuous batching if present
  -> llama-cpp     llama-cpp-python, when installed
-> requests/s, output tokens/s, total tokens/s (+ llmserve's batch and KV statistics)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from llmserve.benchmarks import peers
from llmserve.benchmarks.engine_run import build_engine, drive, release_memory, spec_text
from llmserve.benchmarks.metrics import summarize_ms, throughput_result
from llmserve.benchmarks.report import format_table, machine_info, write_json
from llmserve.benchmarks.workloads import BenchRequest
from llmserve.lora.request import LoRARequest

BACKENDS = ("llmserve", "transformers", "llama-cpp", "all")
HEADLINE_KEYS = ("request_throughput", "output_throughput", "total_token_throughput")


def expand_backends(backend: str) -> list[str]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    return ["llmserve", "transformers", "llama-cpp"] if backend == "all" else [backend]


def run_llmserve(
    engine,
    load_s: float,
    requests: Sequence[BenchRequest],
    temperature: float,
    use_tqdm: bool = True,
    loras: Sequence[LoRARequest | None] | None = None,
) -> dict:
    """All requests at once through an already built engine (request i with ``loras[i]``)."""
    records, elapsed, stats = drive(
        engine, requests, temperature=temperature, use_tqdm=use_tqdm, loras=loras
    )
    result = throughput_result("llmserve", requests, elapsed, sum(r.output_len for r in records))
    result |= stats | summarize_ms("ttft", [r.ttft for r in records if r.ttft is not None])
    return result | {"load_s": load_s, "kv_cache": engine.kv_info}


def run_peer(
    backend: str,
    requests: Sequence[BenchRequest],
    tokenizer,
    args: argparse.Namespace,
    skipped: dict[str, str],
) -> list[dict]:
    """One peer's results (transformers gives two: static and continuous batching)."""
    use_tqdm = not args.disable_tqdm
    if backend == "llama-cpp":
        banned = set(tokenizer.all_special_ids)
        return [
            peers.run_llama_cpp(
                requests, args.model, args.temperature, banned, args.device, use_tqdm
            )
        ]
    model = peers.load_hf_model(args.model, args.device, args.dtype)
    results = [
        peers.run_hf_static(
            model, tokenizer, requests, args.hf_batch_size, args.temperature, use_tqdm
        )
    ]
    if args.hf_continuous:
        try:
            results.append(
                peers.run_hf_continuous(
                    model, tokenizer, requests, args.temperature, args.kv_cache_memory, use_tqdm
                )
            )
        except peers.BackendUnavailable as e:
            print(f"[transformers-cb] skipped: {e}")
            skipped["transformers-cb"] = str(e)
    return results


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any], make_requests) -> dict:
    """Run every chosen backend on the same requests; print a summary; write ``--output-json``.

    ``make_requests(tokenizer)`` builds the workload (the engine's tokenizer when llmserve runs).
    """
    from llmserve.tokenizer import get_tokenizer

    backends = expand_backends(args.backend)
    lora_path = getattr(args, "lora_path", None)
    if lora_path is not None:
        if backends != ["llmserve"]:
            raise ValueError("--lora-path runs on the llmserve backend only")
        engine_kwargs = engine_kwargs | {"enable_lora": True}
    engine = None
    if "llmserve" in backends:
        engine, load_s = build_engine(engine_kwargs)
        tokenizer = engine.tokenizer
    else:
        tokenizer = get_tokenizer(args.model)
    requests = make_requests(tokenizer)
    print(describe_requests(requests))
    loras = None
    if lora_path is not None:  # vLLM's benchmark: each request one of max_loras adapter ids
        max_loras = engine_kwargs.get("max_loras") or 1
        loras = [
            LoRARequest(f"lora-{i % max_loras + 1}", i % max_loras + 1, lora_path)
            for i in range(len(requests))
        ]
    results, skipped = [], {}
    for backend in backends:
        if backend == "llmserve":
            results.append(
                run_llmserve(
                    engine, load_s, requests, args.temperature, not args.disable_tqdm, loras
                )
            )
            engine = None  # free its KV cache before a peer loads
            release_memory()
            continue
        try:
            results.extend(run_peer(backend, requests, tokenizer, args, skipped))
        except peers.BackendUnavailable as e:
            print(f"[{backend}] skipped: {e}")
            skipped[backend] = str(e)
    report = build_report(args, engine_kwargs, requests, results, skipped)
    print(summary_text(report))
    write_json(args.output_json, report)
    return report


def describe_requests(requests: Sequence[BenchRequest]) -> str:
    prompt = [r.prompt_len for r in requests]
    output = [r.output_len for r in requests]
    return (
        f"{len(requests)} requests: prompt tokens mean {sum(prompt) / len(prompt):.1f} "
        f"(min {min(prompt)}, max {max(prompt)}), output tokens mean {sum(output) / len(output):.1f} "
        f"(min {min(output)}, max {max(output)})"
    )


def build_report(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    requests: Sequence[BenchRequest],
    results: list[dict],
    skipped: dict,
) -> dict:
    """Headline keys from the first result (llmserve when it ran), every backend's under "results"."""
    base = next((r for r in results if r["backend"] == "llmserve"), None)
    for r in results:
        ratio = r["output_throughput"] / base["output_throughput"] if base else None
        r["output_throughput_vs_llmserve"] = ratio
    headline = {k: (results[0][k] if results else None) for k in HEADLINE_KEYS}
    return {
        "benchmark": "throughput",
        **headline,
        "backend": results[0]["backend"] if results else None,
        "workload": args.dataset or args.workload,
        "num_prompts": len(requests),
        "total_prompt_tokens": sum(r.prompt_len for r in requests),
        "total_output_tokens": sum(r.output_len for r in requests),
        "temperature": args.temperature,
        "lora_path": getattr(args, "lora_path", None),
        "engine_args": engine_kwargs,
        "machine": machine_info(),
        "results": results,
        "skipped": skipped,
    }


def summary_text(report: dict, markdown: bool = False) -> str:
    rows = [
        [
            r["backend"],
            r["request_throughput"],
            r["output_throughput"],
            r["total_token_throughput"],
            _ratio(r["output_throughput_vs_llmserve"]),
        ]
        for r in report["results"]
    ]
    headers = ["backend", "requests/s", "output tok/s", "total tok/s", "output vs llmserve"]
    text = format_table(headers, rows, markdown) if rows else "no backend ran"
    llmserve = next((r for r in report["results"] if r["backend"] == "llmserve"), None)
    if llmserve:
        text += "\n\n" + engine_stats_text(llmserve)
    for name, why in report["skipped"].items():
        text += f"\nskipped {name}: {why}"
    return text


def engine_stats_text(result: dict) -> str:
    return (
        f"llmserve: {result['num_steps']} steps, sequences per step mean "
        f"{result['mean_seqs_per_step']:.1f} / max {result['max_seqs_per_step']}, "
        f"{result['num_preemptions']} preemptions, prefix cache hit rate "
        f"{100 * result['prefix_hit_rate']:.1f}%, peak KV usage {100 * result['max_kv_usage']:.1f}% "
        f"of {result['num_kv_blocks']} blocks x {result['kv_block_size']} tokens"
    ) + ("; " + spec_text(result) if "spec_num_drafts" in result else "")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
