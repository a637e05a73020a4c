"""The server's periodic stats line, as vLLM's: what the engine did over the last interval.

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 403.1 tokens/s,
    Running: 48 reqs, Waiting: 3 reqs, KV cache usage: 61.2%, Prefix cache hit rate: 12.5%

Read from the engine's snapshot (``AsyncLLMEngine.snapshot``, whatever process the engine runs
in) every ``LLMSERVE_LOG_STATS_INTERVAL`` seconds (default 10, vLLM's
``VLLM_LOG_STATS_INTERVAL``); an interval with no work and none waiting logs nothing, so an
idle server stays quiet. ``llmserve serve --disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

logger = logging.getLogger("llmserve.stats")

INTERVAL_ENV = "LLMSERVE_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def log_interval_s() -> float:
    value = os.environ.get(INTERVAL_ENV)
    if value is None:
        return DEFAULT_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        interval = 0.0
    if not interval > 0:
        raise ValueError(f"{INTERVAL_ENV}={value!r}: expected a number of seconds above 0")
    return interval


class StatsLogger:
    """Turns two snapshots of the engine's counters into one line of rates and gauges."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._last = self._counters()
        self._last_time = time.monotonic()

    def _counters(self) -> tuple[int, int, int, int]:
        s = self.engine.snapshot
        return s.num_prompt_tokens, s.num_generation_tokens, s.num_prefix_queries, s.num_prefix_hits

    def line(self) -> str | None:
        """The line for the interval since the last call; None when nothing happened."""
        now, counters = time.monotonic(), self._counters()
        prompt, generated, queries, hits = (a - b for a, b in zip(counters, self._last))
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = counters, now
        s = self.engine.snapshot
        waiting = self.engine.num_waiting
        if not (prompt or generated or s.num_requests_running or waiting):
            return None
        hit_rate = hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {s.num_requests_running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {s.kv_cache_usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
        )

    async def run(self, interval_s: float) -> None:
        """Log a line every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            line = self.line()
            if line is not None:
                logger.info(line)
