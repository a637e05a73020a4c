"""Offline output tok/s by ``--kv-cache-dtype``, the settings alternated in one process.

One ``LLM`` per KV cache dtype, all loaded first, then the same random prompts through each in
turn, round after round (the order reversed every other round), so a VM's drift hits them
alike; prints each run and the medians as JSON. The numbers of docs/benchmarks.md's "KV cache
quantization" section:

    python benchmarks/kv_cache_dtypes.py --dtype float32 --num-prompts 64 \\
        --kv-cache-dtypes auto fp8 bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8", "bfloat16"])
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from llmserve import LLM, SamplingParams
    from llmserve.benchmarks.workloads import random_requests

    kvs = args.kv_cache_dtypes
    engines = {
        kv: LLM(dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory)
        for kv in kvs
    }
    tokenizer = engines[kvs[0]].get_tokenizer()
    requests = random_requests(tokenizer, args.num_prompts, 0, args.input_len, args.output_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates: dict[str, list[float]] = {kv: [] for kv in kvs}
    for round_no in range(args.rounds):
        for kv in kvs if round_no % 2 == 0 else kvs[::-1]:
            llm = engines[kv]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[kv].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            print(round_no, kv, round(rates[kv][-1], 1), flush=True)
    summary = {
        kv: {"median": round(statistics.median(r), 1), "runs": [round(x, 1) for x in r]}
        for kv, r in rates.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
