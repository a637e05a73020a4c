"""How ordered the KV block tables stay as an engine is used (docs/bench/journal.md, "A used
engine").

"Follows" is the fraction of the running tables' blocks whose id is their predecessor's plus
one, summed over every step: the decode attention kernel reads such runs faster than
scattered blocks.

    python benchmarks/block_order.py simulate   # the real scheduler and block manager, no model
    python benchmarks/block_order.py engine     # the default model: batches on one LLM

``simulate`` drives the scheduler with fake samples (1,456 blocks of 16, 2,048 tokens a step):
six batches of 64 x 256/128 one after the other, Poisson arrivals of 256/128 requests (one
every 3.5 and 1.5 steps), and shared 512-token system prompts picked by a Pareto law (10, 40
and 100 of them, one request every 1.5 steps) for the prefix-cache hit rate. ``engine`` runs
batches of 64 random 256-token prompts x 128 tokens on one ``LLM`` (fp32, 1 GiB of KV,
prefix caching on), timing every engine step. To measure another allocator, put its
``llmserve/engine/block_manager.py`` in place and run the same command.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from llmserve.config import SchedulerConfig
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import FinishReason, Request, Sequence
from llmserve.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 1456, 16


def follows(running) -> tuple[int, int]:
    """(blocks that follow their predecessor, blocks after the first) over ``running``."""
    hits = pairs = 0
    for seq in running:
        ids = seq.block_ids
        hits += sum(b == a + 1 for a, b in zip(ids, ids[1:]))
        pairs += max(0, len(ids) - 1)
    return hits, pairs


class Simulation:
    """The real scheduler and block manager; every sampled token is 7."""

    def __init__(self, seed: int) -> None:
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)
        self.scheduler = Scheduler(config, self.bm)
        self.rng = random.Random(seed)
        self.count = 0
        self.hits = self.pairs = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens)
        request = Request(f"r{self.count}", None, prompt, params, 0)
        request.seqs = [Sequence(self.count, request, 0, list(prompt))]
        self.scheduler.add(request)

    def random_prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(1, 49000) for _ in range(length)]

    def step(self) -> None:
        out = self.scheduler.schedule()
        samples = {
            s.seq.seq_id: [(7, None)] * s.num_samples for s in out.scheduled if s.num_samples
        }
        for sampled in self.scheduler.update(out, samples):
            seq = sampled.seq
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
        hits, pairs = follows(self.scheduler.running)
        self.hits, self.pairs = self.hits + hits, self.pairs + pairs

    def take_follows(self) -> float:
        fraction = self.hits / max(self.pairs, 1)
        self.hits = self.pairs = 0
        return fraction


def simulate() -> None:
    sim = Simulation(seed=0)
    batches = []
    for _ in range(6):
        for _ in range(64):
            sim.add(sim.random_prompt(256), 128)
        while sim.scheduler.has_unfinished():
            sim.step()
        batches.append(f"{sim.take_follows():.3f}")
    print("batches of 64 x 256/128 on one engine, follows:", " ".join(batches))
    for every in (3.5, 1.5):
        sim = Simulation(seed=0)
        for step in range(3000):
            if sim.rng.random() < 1 / every:
                sim.add(sim.random_prompt(256), 128)
            sim.step()
            if step == 999:
                sim.take_follows()
        print(
            f"one arrival every {every} steps, follows (steps 1000-2999): {sim.take_follows():.3f}"
        )
    for num_prompts in (10, 40, 100):
        sim = Simulation(seed=0)
        system = [sim.random_prompt(512) for _ in range(num_prompts)]
        for step in range(3000):
            if sim.rng.random() < 1 / 1.5:
                pick = min(int(sim.rng.paretovariate(1.0)) - 1, num_prompts - 1)
                sim.add(system[pick] + sim.random_prompt(64), 64)
            if step == 1000:
                queries, hits = sim.bm.num_prefix_queries, sim.bm.num_prefix_hits
            sim.step()
        rate = (sim.bm.num_prefix_hits - hits) / (sim.bm.num_prefix_queries - queries)
        print(f"{num_prompts} shared system prompts, prefix-cache hit rate: {rate:.3f}")


def engine(batches: int, dtype: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from llmserve import LLM
    from llmserve.engine.llm_engine import LLMEngine

    llm = LLM(dtype=dtype, kv_cache_memory=1 << 30, enable_prefix_caching=True)
    times: list[float] = []
    counts = [0, 0]
    step = LLMEngine.step

    def timed_step(self):
        start = time.perf_counter()
        outputs = step(self)
        times.append(time.perf_counter() - start)
        hits, pairs = follows(self.scheduler.running)
        counts[0], counts[1] = counts[0] + hits, counts[1] + pairs
        return outputs

    LLMEngine.step = timed_step
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for batch in range(batches):
        rng = random.Random(1000 + batch)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(256)]} for _ in range(64)
        ]
        times.clear()
        counts[:] = [0, 0]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            f"batch {batch + 1}: {tokens / elapsed:.1f} tok/s, {len(times)} steps, median step "
            f"{statistics.median(times) * 1e3:.1f} ms, follows {counts[0] / max(counts[1], 1):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("simulate")
    run = sub.add_parser("engine")
    run.add_argument("--batches", type=int, default=5)
    run.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    simulate() if args.what == "simulate" else engine(args.batches, args.dtype)


if __name__ == "__main__":
    main()
