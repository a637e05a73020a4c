"""Tier 1: the scheduler with fake model outputs (no torch)."""

from __future__ import annotations

import pytest

from llmserve.engine.sequence import SequenceStatus
from tests.fake_engine import FakeEngine, make_request


def test_token_budget_and_seq_limit_respected():
    engine = FakeEngine(num_blocks=256, block_size=4, max_num_batched_tokens=20, max_num_seqs=3)
    engine.add(*[make_request(f"r{i}", prompt_len=9, max_tokens=5) for i in range(6)])
    engine.run()
    for out in engine.outputs:
        assert out.num_batched_tokens <= 20
        assert len(out.scheduled) <= 3
    engine.bm.check_idle()


def test_chunked_prefill_mixes_with_decodes():
    engine = FakeEngine(num_blocks=256, block_size=4, max_num_batched_tokens=8)
    engine.add(make_request("short", prompt_len=3, max_tokens=6))
    engine.step()
    engine.add(make_request("long", prompt_len=30, max_tokens=2))
    out = engine.step()
    kinds = [(s.seq.request.request_id, s.num_tokens) for s in out.scheduled]
    assert kinds == [("short", 1), ("long", 7)]  # decode first, then a 7-token chunk
    engine.run()
    engine.bm.check_idle()


def test_no_chunking_when_disabled_waits_for_budget():
    engine = FakeEngine(
        num_blocks=256, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    engine.add(make_request("long", prompt_len=30, max_tokens=2))
    out = engine.step()
    assert out.is_empty  # the prompt never fits the budget unchunked


def test_fcfs_order():
    engine = FakeEngine(num_blocks=256, block_size=4, max_num_seqs=1)
    for i, t in enumerate([3.0, 1.0, 2.0]):
        engine.add(make_request(f"r{i}", prompt_len=4, max_tokens=1, arrival=t))
    order = []
    while engine.scheduler.has_unfinished():
        out = engine.step()
        order += [s.seq.request.request_id for s in out.scheduled]
    assert order == ["r1", "r2", "r0"]


def test_priority_order():
    engine = FakeEngine(num_blocks=256, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    engine.add(make_request("low", 4, max_tokens=1, priority=5, arrival=1.0))
    engine.add(make_request("high", 4, max_tokens=1, priority=0, arrival=2.0))
    engine.add(make_request("mid", 4, max_tokens=1, priority=2, arrival=0.5))
    order = []
    while engine.scheduler.has_unfinished():
        order += [s.seq.request.request_id for s in engine.step().scheduled]
    assert order == ["high", "mid", "low"]


def _squeezed_pair(num_swap_blocks: int = 0):
    """6 blocks of 4 tokens; each request grows to 8 + 8 = 16 tokens = 4 blocks: two cannot
    coexist, so the later one is preempted."""
    engine = FakeEngine(
        num_blocks=6, block_size=4, prefix_caching=False, num_swap_blocks=num_swap_blocks
    )
    first = make_request("a", 8, max_tokens=8, arrival=1.0)
    second = make_request("b", 8, max_tokens=8, arrival=2.0)
    engine.add(first, second)
    return engine, first, second


def test_preemption_and_resumption_lose_nothing():
    engine, first, second = _squeezed_pair()
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_preempted for o in engine.outputs) == engine.scheduler.num_preemptions
    for request in (first, second):
        assert request.seqs[0].output_token_ids == [7] * 8  # no token lost or duplicated
    engine.bm.check_idle()


def test_swap_preemption_resumes_where_it_stopped():
    # The same squeeze with a swap space: the victim's blocks are copied out and back, so no
    # token of it is computed twice.
    engine, first, second = _squeezed_pair(num_swap_blocks=8)
    swapped_at = None
    while engine.scheduler.has_unfinished():
        out = engine.step()
        if out.blocks_to_swap_out:
            victim = second.seqs[0]
            assert victim.status is SequenceStatus.SWAPPED
            assert [slot for _, slot in out.blocks_to_swap_out] == victim.swap_ids
            assert victim.block_ids == [] and victim.num_computed_tokens > 8
            swapped_at = victim.num_computed_tokens
        if out.blocks_to_swap_in:
            assert swapped_at is not None
            resumed = next(s for s in out.scheduled if s.seq is second.seqs[0])
            # it computed only its next token (the step has run): nothing recomputed
            assert (
                resumed.seq.num_computed_tokens == swapped_at + resumed.num_tokens == swapped_at + 1
            )
            assert [b for _, b in out.blocks_to_swap_in] == resumed.seq.block_ids[
                : len(out.blocks_to_swap_in)
            ]
    assert engine.scheduler.num_preemptions > 0 and swapped_at is not None
    computed = sum(s.num_tokens for o in engine.outputs for s in o.scheduled)
    assert computed == 2 * (8 + 8) - 2  # every token once (the last sampled ones never fed)
    for request in (first, second):
        assert request.seqs[0].output_token_ids == [7] * 8
    engine.bm.check_idle()


def test_swap_space_full_falls_back_to_recompute_and_abort_frees_slots():
    engine, _, _ = _squeezed_pair(num_swap_blocks=1)
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    assert not any(o.blocks_to_swap_out for o in engine.outputs)  # 3 blocks > 1 slot
    engine.bm.check_idle()

    roomy = FakeEngine(num_blocks=6, block_size=4, prefix_caching=False, num_swap_blocks=8)
    third, fourth = make_request("c", 8, max_tokens=8), make_request("d", 8, max_tokens=8)
    roomy.add(third, fourth)
    while fourth.seqs[0].status is not SequenceStatus.SWAPPED:
        roomy.step()
    roomy.scheduler.abort("d")  # a swapped request aborted: its slots come back
    assert len(roomy.bm.free_swap_ids) == 8
    roomy.run()
    roomy.bm.check_idle()


def test_priority_preempts_least_important():
    engine = FakeEngine(
        num_blocks=6, block_size=4, prefix_caching=False, scheduling_policy="priority"
    )
    low = make_request("low", 8, max_tokens=8, priority=9, arrival=1.0)
    engine.add(low)
    engine.step()
    high = make_request("high", 8, max_tokens=8, priority=0, arrival=2.0)
    engine.add(high)
    for _ in range(6):
        engine.step()
    assert low.seqs[0].status is SequenceStatus.WAITING  # pushed out for the important one
    engine.run()
    engine.bm.check_idle()


def test_abort_frees_everything_at_once():
    engine = FakeEngine(num_blocks=64, block_size=4)
    request = make_request("gone", 20, max_tokens=50, n=3)
    engine.add(request, make_request("stays", 5, max_tokens=3))
    engine.step()
    engine.step()
    assert engine.scheduler.abort("gone")
    assert not engine.scheduler.abort("never-existed")
    assert all(s.is_finished and not s.block_ids for s in request.seqs)
    engine.run()
    engine.bm.check_idle()


@pytest.mark.parametrize("n", [1, 3])
def test_many_requests_tiny_pool_all_finish(n):
    engine = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", prompt_len=5 + i % 7, max_tokens=6, n=n) for i in range(12)]
    engine.add(*requests)
    engine.run()
    for r in requests:
        assert all(len(s.output_token_ids) == 6 for s in r.seqs)
    engine.bm.check_idle()
