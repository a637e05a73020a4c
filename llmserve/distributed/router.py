"""Which data-parallel replica takes a request: the longest cached prefix, then the least load.

Each replica's record holds the chained hashes of the prompt blocks it was sent (as its prefix
cache keys them: a block's hash covers every token before it), newest last, bounded:

    prompt tokens:   [t0 .. t15] [t16 .. t31] [t32 .. t40]        block_size 16
    block hashes:     h0 = H(t0..15)   h1 = H(h0, t16..31)        (the partial block: none)
    replica 0 holds {h0, h1} -> 2 blocks cached;  replica 1 holds {h0} -> 1;  replica 0 wins

Among equal prefixes the replica with fewer requests in flight wins (then the lower index).
A replica that restarts starts with an empty record: its cache died with it.
"""

from __future__ import annotations

from collections import OrderedDict

from llmserve.engine.block_manager import salt_hash

MAX_BLOCKS_PER_REPLICA = 1 << 16  # a record larger than any KV pool would hold


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (after ``cache_salt``'s, if any:
    a replica's cache serves a salted prompt only to requests of the same salt)."""
    hashes: list[int] = []
    parent = salt_hash(cache_salt) or 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    """Per replica: the block hashes it has seen (an LRU) and its requests in flight."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.records: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.num_routed = [0] * num_replicas

    def cached_blocks(self, replica: int, hashes: list[int]) -> int:
        """How many leading blocks of the prompt ``replica`` has seen."""
        record = self.records[replica]
        for i, h in enumerate(hashes):
            if h not in record:
                return i
        return len(hashes)

    def choose(
        self, token_ids: list[int], candidates: list[int], cache_salt: str | None = None
    ) -> int:
        """Pick among ``candidates`` (the healthy replicas) and record the choice."""
        if not candidates:
            raise ValueError("no replica to choose from")
        hashes = block_hashes(token_ids, self.block_size, cache_salt)
        best = min(
            candidates,
            key=lambda r: (-self.cached_blocks(r, hashes), self.in_flight[r], r),
        )
        record = self.records[best]
        for h in hashes:
            record[h] = None
            record.move_to_end(h)
        while len(record) > MAX_BLOCKS_PER_REPLICA:
            record.popitem(last=False)
        self.in_flight[best] += 1
        self.num_routed[best] += 1
        return best

    def done(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def forget(self, replica: int) -> None:
        """The replica restarted: nothing of its cache survived."""
        self.records[replica].clear()
