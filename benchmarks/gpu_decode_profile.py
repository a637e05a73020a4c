"""Where a batch-1 decode step's time goes: the host's engine loop, or the device's kernels.

    python benchmarks/gpu_decode_profile.py [--model DIR] [--load-format dummy] [--tokens 128] \
        [--output-json F]

Loads the model (on a GPU with CUDA graphs, as ``llmserve bench attention`` times them; the
random ~1B Llama of ``gpu_vs_transformers.py random-llama`` or ``--load-format dummy`` on its
config), decodes one greedy sequence step by step through ``LLMEngine.step`` and reports,
over the decode steps:

- wall ms a step (everything: scheduler, inputs, graph replay, sampling, outputs);
- device ms a step and kernels a step (torch.profiler's device activity: graph replays
  included), and the idle share ``1 - device / wall``: what the host adds between kernels;
- the kernels with the most time, and the host functions with the most time (cProfile over
  the same steps, without the profiler).

Why: batch-1 MBU on the H200 read 0.25 (docs/benchmarks.md, "GPU a third time"); a 1.64 GB
step at 0.6 of 4.8 TB/s is 0.57 ms. A large idle share says the host (the engine's Python
between two replays) is the limit, device ms far above 0.57 says the kernels are. On a
machine without a GPU it runs on the CPU with the host profile alone (the CPU kernels are
host functions there), which checks the script and shows the CPU step's host side.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import Counter

import torch


def build_engine(args: argparse.Namespace):
    from llmserve import LLM

    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.tokens + 16,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    return llm.llm_engine


def decode_steps(engine, prompt: list[int], tokens: int) -> list[float]:
    """Add one greedy request, run its prompt step, then time each decode step (seconds)."""
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def device_profile(engine, prompt: list[int], tokens: int) -> dict:
    """Kernels a step, device ms a step and the top kernels, from torch.profiler (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = decode_steps(engine, prompt, tokens)
    total_us = Counter()
    count = Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total_us[e.name] += e.device_time
            count[e.name] += 1
    n = len(steps)
    return {
        "steps": n,
        "kernels_per_step": sum(count.values()) / n,
        "device_ms_per_step": sum(total_us.values()) / 1e3 / n,
        "top": [
            {"name": name[:90], "calls_per_step": count[name] / n, "ms_per_step": us / 1e3 / n}
            for name, us in total_us.most_common(15)
        ],
    }


def host_profile(engine, prompt: list[int], tokens: int) -> list[dict]:
    """The host functions with the most cumulative time over the decode steps (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    steps = decode_steps(engine, prompt, tokens)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:20]
    return [
        {
            "function": f"{fn} ({'/'.join(file.rsplit('/', 2)[-2:])}:{line})",
            "self_ms_per_step": tt * 1e3 / len(steps),
            "calls_per_step": nc / len(steps),
        }
        for (file, line, fn), (_, nc, tt, _, _) in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--output-json")
    args = parser.parse_args()

    engine = build_engine(args)
    on_cuda = engine.runner.device.type == "cuda"
    prompt = list(range(1, args.prompt_len + 1))
    decode_steps(engine, prompt, 8)  # warm-up: graphs captured, kernels compiled
    wall = sorted(decode_steps(engine, prompt, args.tokens))
    result = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "wall_ms_per_step_median": wall[len(wall) // 2] * 1e3,
        "wall_ms_per_step_mean": sum(wall) / len(wall) * 1e3,
    }
    print(f"{result['device']}: wall {result['wall_ms_per_step_median']:.3f} ms a step "
          f"(median; mean {result['wall_ms_per_step_mean']:.3f})")  # fmt: skip
    if on_cuda:  # on the CPU the model's own kernels are host functions: cProfile shows them
        dev = result["device_profile"] = device_profile(engine, prompt, args.tokens)
        result["idle_share"] = 1 - dev["device_ms_per_step"] / result["wall_ms_per_step_mean"]
        print(f"device {dev['device_ms_per_step']:.3f} ms in {dev['kernels_per_step']:.0f} "
              f"kernels a step, idle share {result['idle_share']:.2f}")  # fmt: skip
        print("\ntop kernels (ms a step, calls a step):")
        for k in dev["top"]:
            print(f"  {k['ms_per_step']:8.4f} {k['calls_per_step']:6.1f}  {k['name']}")
    result["host_profile"] = host_profile(engine, prompt, args.tokens)
    print("\ntop host functions, self time (ms a step, calls a step; under cProfile):")
    for h in result["host_profile"]:
        print(f"  {h['self_ms_per_step']:8.4f} {h['calls_per_step']:7.1f}  {h['function']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
