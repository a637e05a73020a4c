"""``python -m llmserve.benchmarks.dtype_fidelity``: what bf16 costs in fidelity on the CPU.

Greedy continuations of the default model (or ``--model``) from llmserve in each ``--dtype``
and attention backend, against transformers in float32 on the same weights (the reference
tests/test_model_correctness.py uses), each prompt alone. Reported per configuration:

  exact       prompts whose whole continuation equals the reference's
  prefix      mean fraction of tokens generated before the first divergence
  top5        prompts where, at the first divergence, the reference's token is in llmserve's
              top 5 (tier 3 of STYLE.md: a near-tie, not a broken kernel); divergence-free
              prompts count too (llmserve runs only: they return logprobs)

The prompts mix prose, code, SQL and lists; transformers in bf16 is measured too, as the
fidelity cost of bf16 itself (independent of llmserve's kernels).
"""

from __future__ import annotations

import argparse

import torch

from llmserve.benchmarks.report import format_table, machine_info, write_json

PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):",
    "SELECT name FROM users WHERE",
    "Write SQL that counts rows of t.",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\ndef softmax(x):",
    "Q: What is 12 times 12?\nA:",
    "A list of fruits: apple, banana,",
    "The theory of relativity states that",
    "CREATE TABLE orders (id INTEGER, user_id INTEGER, total REAL);\n-- total per user\nSELECT",
    "In machine learning, overfitting means",
    "The quick brown fox",
    "Steps to make tea:\n1.",
    "class Stack:\n    def __init__(self):",
    "The largest planet in the solar system is",
    "Dear customer, we are sorry to inform you that",
    "for (int i = 0; i < n; ++i) {",
    "Photosynthesis is the process by which",
]


def reference(model: str | None, prompts: list[str], num_tokens: int, dtype: torch.dtype):
    """transformers' greedy continuations (and the tokenized prompts)."""
    from transformers import AutoModelForCausalLM

    from llmserve.loader import resolve_model
    from llmserve.tokenizer import get_tokenizer

    resolved = resolve_model(model)
    tokenizer = get_tokenizer(resolved)
    hf = AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, dtype=dtype
    )
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = hf.generate(
            ids,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def llmserve_runs(model, prompts, num_tokens, dtype: str, backend: str):
    """llmserve's greedy tokens and top-5 logprobs, each prompt alone."""
    from llmserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, attention_backend=backend, max_model_len=512)
    params = SamplingParams(
        temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens, logprobs=5
    )
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]


def agreement(outputs, expected: list[list[int]]) -> dict[str, float]:
    """exact / prefix / top5 of llmserve's outputs against the reference's token ids."""
    exact, prefix, top5 = 0, 0.0, 0
    for out, ref in zip(outputs, expected):
        ids = out.token_ids if hasattr(out, "token_ids") else out
        n = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        if n is None:
            exact, prefix, top5 = exact + 1, prefix + 1.0, top5 + 1
            continue
        prefix += n / len(ref)
        top5 += int(hasattr(out, "logprobs") and ref[n] in out.logprobs[n])
    count = len(expected)
    has_logprobs = bool(outputs) and hasattr(outputs[0], "logprobs")
    return {
        "exact": exact / count,
        "prefix": prefix / count,
        "top5": top5 / count if has_logprobs else None,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("--model", default=None)
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument(
        "--configs",
        nargs="+",
        default=["float32:cpp", "bfloat16:cpp", "bfloat16:torch"],
        help="dtype:attention_backend pairs",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    ref = reference(args.model, PROMPTS, args.num_tokens, torch.float32)
    rows = {
        "transformers bfloat16": agreement(
            reference(args.model, PROMPTS, args.num_tokens, torch.bfloat16), ref
        )
    }
    for config in args.configs:
        dtype, backend = config.split(":")
        outputs = llmserve_runs(args.model, PROMPTS, args.num_tokens, dtype, backend)
        rows[f"llmserve {dtype} {backend}"] = agreement(outputs, ref)
    print(
        f"greedy agreement with transformers float32, {len(PROMPTS)} prompts x {args.num_tokens} tokens"
    )
    print(
        format_table(
            ["run", "exact", "prefix", "top5"],
            [[k, v["exact"], v["prefix"], v["top5"]] for k, v in rows.items()],
        )
    )
    report = {
        "machine": machine_info(),
        "num_prompts": len(PROMPTS),
        "num_tokens": args.num_tokens,
        "runs": rows,
    }
    if args.output_json:
        write_json(args.output_json, report)
    return report


if __name__ == "__main__":
    main()
