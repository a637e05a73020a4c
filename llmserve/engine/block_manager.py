"""The KV block manager: block tables, reference counts, copy-on-write, prefix caching.

The KV pool is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's block table
maps its logical blocks to physical ones, like virtual memory:

    positions:   0..15        16..31       32..37 (partial)
    block table: [   7    ,      2    ,       9    ]   slot(p) = table[p // 16] * 16 + p % 16

Blocks carry a reference count. Forked sequences (parallel sampling) share the prompt's
blocks; the first one to append into a shared *partial* block gets a private copy
(copy-on-write, recorded in ``blocks_to_copy`` for the runner to apply).

Prefix caching: every *full* block gets a hash chained over all tokens before it. A new
sequence whose leading blocks hash the same reuses them, cached or computed in the same step
by a sequence scheduled before it (``offer_in_step``). Blocks whose reference count drops
to zero keep their hash until they are handed out again (evicted).

Which free block goes next: a clock hand sweeps the pool in address order and hands out the
first unreferenced block at or after it, wrapping at the end (CLOCK, an approximation of LRU:
a block waits about one sweep after it is freed). A block that has served a prefix-cache hit
gets a second chance: the hand passes it once, so hot prefixes outlive a sweep. Address order
is the point: a prompt's blocks come out as one ascending run wherever the pool ahead of the
hand is free, and the decode attention kernel reads such runs 1.2x faster than scattered
blocks (the hardware prefetchers follow them). An LRU list hands out blocks in the order they
were freed, and a used engine's tables drift from runs to scatter: measured on an AMD Zen 5
host (fp32, 64 x 256/128, one engine, ``benchmarks/block_order.py engine``), 68 -> 75 ms a
median decode step by the fifth batch (docs/bench/journal.md, "A used engine").

Swap space (``num_swap_blocks`` slots outside the pool, vLLM's ``--swap-space``): a sequence
preempted by swapping has its blocks copied to free slots and released (``swap_out``), and
copied back into fresh blocks when it resumes (``swap_in``); the copies are recorded in
``blocks_to_swap_out`` / ``blocks_to_swap_in`` for the runner, which applies them before the
step's forward pass, swap-outs first.
"""

from __future__ import annotations

from collections import deque

from llmserve.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained over every token before it through ``parent_hash``."""
    return hash((parent_hash, token_ids))


def salt_hash(cache_salt: str | None, lora_int_id: int = 0) -> int | None:
    """The parent of a request's first block: None, or the hash of its ``cache_salt`` and
    LoRA adapter, so that requests with different salts (tenants) or adapters (whose KV of one
    prompt differs) never share cached blocks, even of one prompt."""
    if cache_salt is None and not lora_int_id:
        return None
    return hash(("cache_salt", cache_salt, lora_int_id))


class BlockManager:
    """Owns the pool's free list, reference counts and the prefix-cache map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: dict[int, int] = {}  # block id -> hash (cached blocks only)
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.is_free = bytearray(b"\x01" * num_blocks)  # 1: unreferenced (maybe still cached)
        self.second_chance = bytearray(num_blocks)  # 1: served a cache hit; the hand passes once
        self.hand = 0  # where the search for the next free block starts
        self._num_free = num_blocks
        self.in_step: dict[int, int] = {}  # hash -> block id: full blocks this step computes
        self.blocks_to_copy: list[tuple[int, int]] = []  # (src, dst) copies pending this step
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_ids: deque[int] = deque(range(num_swap_blocks))
        self.blocks_to_swap_out: list[tuple[int, int]] = []  # (block, swap slot) this step
        self.blocks_to_swap_in: list[tuple[int, int]] = []  # (swap slot, block) this step
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which served from it

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        needed = max(0, total - len(seq.block_ids))
        return needed + (1 if self._needs_copy_on_write(seq) else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens (copy-on-write included)."""
        assert self.can_allocate(seq, num_new_tokens)
        if self._needs_copy_on_write(seq):
            self._copy_on_write(seq)
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        # Sorted: a run that wraps past the pool's end still reads ascending in two parts (the
        # decode kernel reads descending blocks no faster than scattered ones).
        new = sorted(self._take_free_block() for _ in range(total - len(seq.block_ids)))
        seq.block_ids.extend(new)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (and swap slots); cached blocks stay reusable until
        evicted."""
        for block_id in seq.block_ids:
            self._release(block_id)
        seq.block_ids = []
        seq.block_hashes = []
        self.free_swap_ids.extend(seq.swap_ids)
        seq.swap_ids = []

    # ---- swap space -------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_ids) <= len(self.free_swap_ids)

    def swap_out(self, seq: Sequence) -> None:
        """Copy ``seq``'s blocks to swap slots and release them (shared ones stay with their
        other owners)."""
        assert self.can_swap_out(seq) and not seq.swap_ids
        for block_id in seq.block_ids:
            slot = self.free_swap_ids.popleft()
            self.blocks_to_swap_out.append((block_id, slot))
            seq.swap_ids.append(slot)
        for block_id in seq.block_ids:
            self._release(block_id)
        seq.block_ids = []
        seq.block_hashes = []  # the blocks it comes back to are registered anew

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(total, len(seq.swap_ids)) <= self.num_free_blocks

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> None:
        """Copy ``seq``'s swapped KV into fresh blocks, with slots for ``num_new_tokens``."""
        assert self.can_swap_in(seq, num_new_tokens) and not seq.block_ids
        for slot in seq.swap_ids:
            block_id = self._take_free_block()
            self.blocks_to_swap_in.append((slot, block_id))
            seq.block_ids.append(block_id)
        self.free_swap_ids.extend(seq.swap_ids)
        seq.swap_ids = []
        self.allocate(seq, num_new_tokens)
        self.cache_full_blocks(seq)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (swap-outs, swap-ins), emptied."""
        swaps = (self.blocks_to_swap_out, self.blocks_to_swap_in)
        self.blocks_to_swap_out, self.blocks_to_swap_in = [], []
        return swaps

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past ``seq.num_computed_tokens`` (slots of rejected drafts)."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        while len(seq.block_ids) > keep:
            self._release(seq.block_ids.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of ``parent``'s blocks with ``child`` (parallel sampling)."""
        for block_id in parent.block_ids:
            self.ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    # ---- prefix caching ---------------------------------------------------------------
    def acquire_cached_prefix(self, seq: Sequence) -> int:
        """Point ``seq``'s table at cached blocks of its longest cached prefix.

        Returns the number of tokens found. At least one token is always left to compute,
        so the step that finishes the prompt has logits to sample from.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hashes = self._new_block_hashes(seq, seq.num_tokens // self.block_size)
        if len(hashes) * self.block_size == seq.num_tokens:
            hashes = hashes[:-1]  # keep the last block to compute
        for block_hash in hashes:
            block_id = self.cached_blocks.get(block_hash, self.in_step.get(block_hash))
            if block_id is None:
                break
            self._acquire(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(block_hash)
        num_hit_tokens = len(seq.block_ids) * self.block_size
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += num_hit_tokens
        return num_hit_tokens

    def offer_in_step(self, seq: Sequence, num_new_tokens: int) -> None:
        """Let sequences admitted later in this step share the full blocks that ``seq``'s next
        ``num_new_tokens`` tokens complete (``in_step``, cleared by the scheduler when the step
        is planned): a forward pass writes every token's K/V before any attention reads them,
        so a prompt that shares a prefix with one computed beside it need not compute it too.
        The blocks enter the cache proper once computed (``cache_full_blocks``): a step that
        fails leaves no block cached that holds no K/V."""
        if not self.enable_prefix_caching:
            return
        end = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        first = len(seq.block_hashes)
        if end <= first:  # a decode row 15 steps in 16: nothing to offer
            return
        for i, block_hash in enumerate(self._new_block_hashes(seq, end), first):
            if block_hash not in self.cached_blocks:
                self.in_step.setdefault(block_hash, seq.block_ids[i])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` filled completely since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = len(seq.block_hashes)
        for i, block_hash in enumerate(self._new_block_hashes(seq, num_full), first):
            seq.block_hashes.append(block_hash)
            block_id = seq.block_ids[i]
            if block_hash not in self.cached_blocks and block_id not in self.block_hash:
                self.cached_blocks[block_hash] = block_id
                self.block_hash[block_id] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of every unreferenced block (those in use keep theirs)."""
        for block_id in [b for b in self.block_hash if self.is_free[b]]:
            self._drop_hash(block_id)
            self.second_chance[block_id] = 0

    # ---- invariants -------------------------------------------------------------------
    def check_idle(self) -> None:
        """Raise if any block is still referenced (call when no request is alive)."""
        leaked = [b for b, count in enumerate(self.ref_counts) if count != 0]
        if leaked or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"leaked KV blocks {leaked[:16]} (free {self.num_free_blocks})")
        if len(self.free_swap_ids) != self.num_swap_blocks:
            raise AssertionError(f"leaked swap slots ({len(self.free_swap_ids)} free)")

    # ---- internals --------------------------------------------------------------------
    def _new_block_hashes(self, seq: Sequence, end: int) -> list[int]:
        """The chained hashes of ``seq``'s blocks from the first not yet in ``block_hashes``
        up to block ``end`` (exclusive)."""
        hashes: list[int] = []
        request = seq.request
        parent = (
            seq.block_hashes[-1]
            if seq.block_hashes
            else salt_hash(request.cache_salt, request.lora_int_id)
        )
        for i in range(len(seq.block_hashes), end):
            start = i * self.block_size
            parent = hash_block(parent, tuple(seq.token_ids[start : start + self.block_size]))
            hashes.append(parent)
        return hashes

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """True when ``seq`` is about to write into a partial block it shares."""
        offset = seq.num_computed_tokens % self.block_size
        if offset == 0 or not seq.block_ids:
            return False
        block_id = seq.block_ids[seq.num_computed_tokens // self.block_size]
        return self.ref_counts[block_id] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        src = seq.block_ids[index]
        dst = self._take_free_block()
        self.ref_counts[src] -= 1
        seq.block_ids[index] = dst
        self.blocks_to_copy.append((src, dst))

    def _take_free_block(self) -> int:
        """The first free block at or after the hand (wrapping), passing each block that has
        a second chance once; its hash, if it had one, is forgotten (evicted)."""
        assert self._num_free > 0
        while True:
            block_id = self.is_free.find(1, self.hand)
            if block_id < 0:
                block_id = self.is_free.find(1)
            self.hand = block_id + 1
            if not self.second_chance[block_id]:
                break
            self.second_chance[block_id] = 0
        self.is_free[block_id] = 0
        self._num_free -= 1
        if block_id in self.block_hash:
            self._drop_hash(block_id)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        """A prefix-cache hit on ``block_id``."""
        if self.ref_counts[block_id] == 0:
            self.is_free[block_id] = 0
            self._num_free -= 1
        self.second_chance[block_id] = 1
        self.ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self.is_free[block_id] = 1
            self._num_free += 1

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hash.pop(block_id)
        del self.cached_blocks[block_hash]
