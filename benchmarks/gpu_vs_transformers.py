"""llmserve against transformers on one CUDA GPU, same weights: greedy agreement and speed.

    python benchmarks/gpu_vs_transformers.py random-llama --output DIR   # ~1B random Llama
    python benchmarks/gpu_vs_transformers.py compare --model M --dtype bfloat16 \
        --output-json F

``random-llama`` writes a Llama of the shape ``llmserve bench attention`` uses for its CUDA
graph figures (hidden 2048, 16 layers, 32 heads, 8 KV heads; tokenizer of ``--tokenizer``,
default the default model's) with seeded random weights, so both engines load real tensors.
``compare`` runs the same prompts greedily through transformers (``generate``, one padded
batch) and llmserve (``LLM.generate``) and reports how many sequences are token-identical,
where the others first differ, and each engine's batch-1 and batch-N decode tok/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def random_llama(output: str, tokenizer: str | None, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmserve.benchmarks.attention_gpu import write_llama_1b

    write_llama_1b(output, tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(output)).to(torch.bfloat16)
    model.save_pretrained(output)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    texts = [topics[k][:400] for k in sorted(topics)[:n]]
    return [tokenizer(t).input_ids[:64] for t in texts]


def hf_generate(model_path: str, dtype: torch.dtype, prompts: list[list[int]], num_tokens: int):
    """Greedy tokens per prompt (one left-padded batch) and batch-1 / batch-N tok/s."""
    from llmserve.benchmarks.peers import load_hf_model

    model = load_hf_model(model_path, "cuda", str(dtype).removeprefix("torch."))
    pad = 0  # masked out; any id will do

    def run(batch: list[list[int]]) -> tuple[list[list[int]], float]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=num_tokens,
            min_new_tokens=num_tokens, pad_token_id=pad,
        )  # fmt: skip
        torch.cuda.synchronize()
        return out[:, width:].tolist(), time.perf_counter() - start

    return _speeds(run, prompts, num_tokens)


def llmserve_generate(model_path: str, dtype: torch.dtype, prompts, num_tokens: int, eager: bool):
    from llmserve import LLM, SamplingParams

    llm = LLM(model_path, dtype=str(dtype).removeprefix("torch."), enforce_eager=eager,
              max_model_len=256, enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    def run(batch):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        torch.cuda.synchronize()
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    return _speeds(run, prompts, num_tokens)


def _speeds(run, prompts, num_tokens: int) -> tuple[list, dict]:
    """``run(batch) -> (tokens, seconds)`` warmed up, then timed on one prompt and on all."""
    run(prompts[:1])  # warm-up
    _, one = run(prompts[:1])
    tokens, many = run(prompts)
    speed = {
        "batch1_tok_s": num_tokens / one,
        f"batch{len(prompts)}_tok_s": len(prompts) * num_tokens / many,
    }
    return tokens, speed


def compare(args: argparse.Namespace) -> dict:
    from llmserve.tokenizer import get_tokenizer

    dtype = getattr(torch, args.dtype)
    prompts = _prompts(get_tokenizer(args.model), args.num_prompts)
    hf_tokens, hf_speed = hf_generate(args.model, dtype, prompts, args.num_tokens)
    gc.collect()
    torch.cuda.empty_cache()
    ours, our_speed = llmserve_generate(
        args.model, dtype, prompts, args.num_tokens, args.enforce_eager
    )
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        for x, y in zip(hf_tokens, ours)
    ]
    report = {
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "dtype": args.dtype,
        "prompts": len(prompts),
        "tokens": args.num_tokens,
        "identical_sequences": sum(d is None for d in first_diff),
        "first_difference_at": first_diff,
        "transformers": hf_speed,
        "llmserve": our_speed | {"cuda_graphs": not args.enforce_eager},
    }
    print(json.dumps(report, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("random-llama")
    r.add_argument("--output", required=True)
    r.add_argument("--tokenizer", default=None)
    r.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    c.add_argument("--num-prompts", type=int, default=16)
    c.add_argument("--num-tokens", type=int, default=64)
    c.add_argument("--enforce-eager", action="store_true")
    c.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.command == "random-llama":
        random_llama(args.output, args.tokenizer, args.seed)
    else:
        compare(args)


if __name__ == "__main__":
    main()
