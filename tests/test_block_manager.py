"""Tier 1: block tables, reference counts, copy-on-write, parallel sampling, prefix caching."""

from __future__ import annotations

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.sequence import Sequence
from tests.fake_engine import FakeEngine, make_request


def _seq(prompt: list[int]) -> Sequence:
    return make_request("r", len(prompt), prompt=prompt).seqs[0]


def test_allocation_wastes_less_than_one_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = _seq(list(range(10)))
    bm.allocate(seq, 10)
    assert len(seq.block_ids) == 3  # 10 tokens -> 3 blocks of 4, 2 slots unused
    assert bm.num_free_blocks == 13
    bm.free(seq)
    bm.check_idle()


def test_copy_on_write_on_shared_partial_block():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent = _seq(list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = Sequence(999, parent.request, 1, list(parent.token_ids))
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    shared_partial = parent.block_ids[1]
    assert bm.ref_counts[shared_partial] == 2 and child.block_ids == parent.block_ids
    bm.allocate(child, 1)  # child appends into the shared partial block -> private copy
    assert child.block_ids[1] != shared_partial
    assert child.block_ids[0] == parent.block_ids[0]  # the full block stays shared
    assert bm.take_blocks_to_copy() == [(shared_partial, child.block_ids[1])]
    assert bm.ref_counts[shared_partial] == 1
    bm.allocate(parent, 1)  # now the parent is alone in its block: no copy
    assert parent.block_ids[1] == shared_partial and bm.take_blocks_to_copy() == []
    bm.free(parent)
    bm.free(child)
    bm.check_idle()


def test_parallel_sampling_shares_prompt_blocks():
    engine = FakeEngine(num_blocks=64, block_size=4, prefix_caching=False)
    request = make_request("n4", prompt_len=10, max_tokens=3, n=4)
    engine.add(request)
    engine.step()  # prefill once, sample 4 first tokens, fork
    assert request.is_forked and all(len(s.output_token_ids) == 1 for s in request.seqs)
    # 10 prompt tokens -> 3 blocks, computed once and shared by all 4 sequences.
    physical = {b for s in request.seqs for b in s.block_ids}
    assert len(physical) == 3
    assert engine.bm.ref_counts[request.seqs[0].block_ids[0]] == 4
    engine.step()  # each appends at position 10: the shared partial block is copied 3 times
    physical = {b for s in request.seqs for b in s.block_ids}
    assert len(physical) == 2 + 4
    assert len(engine.outputs[-1].blocks_to_copy) == 3
    engine.run()
    assert [s.output_token_ids for s in request.seqs] == [
        [7, 7, 7],
        [8, 7, 7],
        [9, 7, 7],
        [10, 7, 7],
    ]
    engine.bm.check_idle()


def test_prefix_cache_hit_and_counters():
    engine = FakeEngine(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    engine.add(make_request("a", 0, prompt=prompt))
    engine.run()
    second = make_request("b", 0, prompt=prompt + [50, 51])
    engine.add(second)
    out = engine.step()
    assert second.seqs[0].num_cached_tokens == 12
    assert out.scheduled[0].num_tokens == 15 - 12  # only the new part is computed
    assert engine.bm.num_prefix_hits == 12
    engine.run()
    engine.bm.check_idle()


def test_prompts_admitted_in_one_step_share_the_prefix_computed_in_it():
    engine = FakeEngine(num_blocks=32, block_size=4)
    prefix = list(range(1, 10))  # 9 tokens: 2 full blocks shared, then the prompts differ
    first, second = (make_request(r, 0, prompt=prefix + [t]) for r, t in (("a", 50), ("b", 51)))
    engine.add(first)
    engine.add(second)
    out = engine.step()  # both admitted in one step: b reads a's two blocks, computed beside it
    a, b = first.seqs[0], second.seqs[0]
    assert [s.num_tokens for s in out.scheduled] == [10, 10 - 8]
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert engine.bm.num_prefix_hits == 8 and not engine.bm.in_step
    assert engine.bm.cached_blocks  # registered once the step computed them
    engine.run()
    engine.bm.check_idle()


def test_blocks_of_a_failed_step_are_never_cached():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = _seq(list(range(1, 10))), _seq(list(range(1, 10)) + [77])
    bm.allocate(a, 9)
    bm.offer_in_step(a, 9)
    assert bm.acquire_cached_prefix(b) == 8  # shared within the step
    bm.in_step.clear()  # the step is planned; its forward pass fails: nobody caches
    bm.free(b)
    bm.free(a)
    assert not bm.cached_blocks and not bm.evictable
    c = _seq(list(range(1, 10)))
    assert bm.acquire_cached_prefix(c) == 0  # nothing to read that holds no K/V
    bm.check_idle()


def test_fully_cached_prompt_still_computes_last_block():
    engine = FakeEngine(num_blocks=32, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    engine.add(make_request("a", 0, prompt=prompt))
    engine.run()
    engine.add(make_request("b", 0, prompt=prompt))
    out = engine.step()
    assert out.scheduled[0].num_tokens == 4  # first block reused, last one recomputed
    engine.run()
    engine.bm.check_idle()


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = _seq([1, 2, 3, 4]), _seq([5, 6, 7, 8])
    old_blocks = None
    for seq in (old, new):
        bm.allocate(seq, 4)
        old_blocks = old_blocks or list(seq.block_ids)
        seq.num_computed_tokens = 4
        bm.cache_full_blocks(seq)
        bm.free(seq)
    assert len(bm.cached_blocks) == 4 and bm.num_free_blocks == 4
    taker = _seq([9, 9])
    old_head, old_tail = old_blocks
    bm.allocate(taker, 2)  # no never-used block left: evicts the least recently freed
    assert taker.block_ids == [old_tail]  # freed tail-first, so old's tail goes first
    assert len(bm.cached_blocks) == 3
    probe = _seq([1, 2, 3, 4, 0])
    assert bm.acquire_cached_prefix(probe) == 2  # old's head survives, its tail is gone
    assert probe.block_ids == [old_head]
    probe2 = _seq([5, 6, 7, 8, 0])
    assert bm.acquire_cached_prefix(probe2) == 4  # new's blocks survive
    bm.free(probe)
    bm.free(probe2)
    bm.free(taker)
    bm.check_idle()


def test_multi_round_chat_computes_only_new_turn():
    engine = FakeEngine(num_blocks=64, block_size=4)
    history = list(range(1, 30))
    first = make_request("turn1", 0, prompt=history, max_tokens=8)
    engine.add(first)
    engine.run()
    resent = history + first.seqs[0].output_token_ids + [60, 61, 62]
    engine.add(make_request("turn2", 0, prompt=resent))
    out = engine.step()
    # Everything but the partial last block (and what follows) comes from the cache.
    assert out.scheduled[0].num_tokens <= 4 + 3
    engine.run()
    engine.bm.check_idle()


def test_blocks_come_back_in_ascending_order():
    # free() releases a sequence tail first (so a cached prefix keeps its head longest); the
    # next sequence must still get those blocks in ascending order, as the decode kernel reads
    # descending blocks as slowly as scattered ones
    for prefix_caching in (True, False):
        bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=prefix_caching)
        first = _seq(list(range(32)))  # the whole pool: ids 0..7 in order
        bm.allocate(first, 32)
        assert first.block_ids == list(range(8))
        first.num_computed_tokens = 32
        bm.free(first)  # released 7, 6, ..., 0
        second = _seq(list(range(100, 120)))  # 5 blocks, none cached
        bm.allocate(second, 20)
        assert second.block_ids == sorted(second.block_ids) and len(second.block_ids) == 5
        assert second.block_ids == [3, 4, 5, 6, 7]  # the first five released, ascending
        bm.free(second)
        bm.check_idle()
