"""Sampler: greedy, seeded draws, truncation, temperature, penalties, masks, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.runner.logprobs import compute_prompt_logprobs
from llmserve.runner.penalties import apply_penalties
from llmserve.runner.sampler import (
    OutputTokens,
    Sampler,
    SamplingRow,
    argmax_and_probs,
    greedy,
    penalized_logits,
    sampling_probs,
)
from llmserve.runner.truncation import apply_top_k_top_p, top_k_top_p_sorted
from llmserve.sampling_params import SamplingParams


def make_row(
    params: SamplingParams,
    output_token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    eos_token_id: int | None = None,
) -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt_token_ids or [],
        output_token_ids=output_token_ids or [],
        generator=generator,
        eos_token_id=eos_token_id,
    )


def sample_many(
    logits_row: torch.Tensor, params: SamplingParams, num: int, kernels: str = "torch"
) -> torch.Tensor:
    """[num] sampled ids: the same row of logits repeated num times in one batch."""
    logits = logits_row.expand(num, -1)  # [num, vocab]
    out = Sampler(kernels)(logits, [make_row(params) for _ in range(num)])
    return torch.tensor(out.sampled_token_ids)


def needs_cpp(kernels: str) -> None:
    """Skip a ``kernels="cpp"`` case where the C++ CPU kernels are not built."""
    from llmserve.kernels import cpu as cpu_kernels

    if kernels == "cpp" and not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here")


KERNELS = ["torch", "cpp"]


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()  # [vocab]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_greedy_is_argmax_also_beside_random_rows():
    logits = torch.randn(6, 500)  # [rows, vocab]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = Sampler()(logits, [make_row(p) for p in params])
    expected = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    all_greedy = Sampler()(logits, [make_row(SamplingParams(temperature=0.0))] * 6)
    assert all_greedy.sampled_token_ids == expected
    assert all_greedy.logprobs == [None] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_greedy_takes_the_same_tokens_as_torch(dtype):
    """``Sampler("cpp")``: greedy rows by the C++ argmax (skip where it is not built), in the
    logits' own dtype, with and without rows that bias or draw beside them."""
    from llmserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here")
    logits = (torch.randn(9, 3000) * 4).round().to(dtype)  # ties: the first index wins
    greedy_rows = [make_row(SamplingParams(temperature=0.0, logprobs=2))] * 9
    out = Sampler("cpp")(logits, greedy_rows)
    assert out.sampled_token_ids == logits.float().max(dim=-1).indices.tolist()
    assert out.logprobs == Sampler()(logits, greedy_rows).logprobs
    assert torch.equal(greedy(logits, "cpp"), logits.max(dim=-1).indices)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 4
    params.append(SamplingParams(temperature=0.0, logit_bias={7: 100.0}))
    mixed = [make_row(p) for p in params]
    fresh = [make_row(p) for p in params]  # seeded rows draw again from the same seed
    assert (
        Sampler("cpp")(logits, mixed).sampled_token_ids
        == Sampler()(logits, fresh).sampled_token_ids
    )
    assert Sampler("cpp")(logits[:1], [make_row(params[-1])]).sampled_token_ids == [7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_sampled_in_any_dtype_and_left_unmodified(dtype):
    logits = torch.randn(3, 64).to(dtype)  # [rows, vocab]
    before = logits.clone()
    params = SamplingParams(
        temperature=0.5, top_p=0.9, min_p=0.05, logit_bias={5: 100.0}, repetition_penalty=1.5
    )
    min_tokens = SamplingParams(temperature=0.0, min_tokens=4, frequency_penalty=1.0)
    rows = [make_row(params, output_token_ids=[1, 2])] * 2
    rows.append(make_row(min_tokens, output_token_ids=[1], eos_token_id=int(logits[2].argmax())))
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids[:2] == [5, 5]
    assert out.sampled_token_ids[2] != int(logits[2].argmax())
    assert torch.equal(logits, before)


def run_seeded(
    seed: int,
    position: int,
    others: list[SamplingParams],
    steps: int = 12,
    top_p: float = 0.95,
    kernels: str = "torch",
):
    """Tokens of one seeded row over several steps, at `position` among `others`."""
    vocab = 1000
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(99)) * 0.1
    target = make_row(SamplingParams(temperature=0.9, top_p=top_p, seed=seed))
    tokens = []
    for _ in range(steps):
        rows = [make_row(p) for p in others]
        rows.insert(position, target)
        logits = torch.randn(len(rows), vocab)  # [rows, vocab]
        logits[position] = target_logits
        tokens.append(Sampler(kernels)(logits, rows).sampled_token_ids[position])
    return tokens


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("top_p", [0.95, 1.0])  # 1.0 with "cpp": the fused draw_rows
def test_same_seed_same_tokens_whatever_the_batch(top_p, kernels):
    needs_cpp(kernels)
    alone = run_seeded(seed=1234, position=0, others=[], top_p=top_p, kernels=kernels)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=7, top_k=5),
        SamplingParams(temperature=1.2, min_p=0.1),
    ]
    for position, batch in ((2, others), (4, others[::-1]), (1, others[:1])):
        assert run_seeded(1234, position, batch, top_p=top_p, kernels=kernels) == alone
    assert run_seeded(1235, 0, [], top_p=top_p, kernels=kernels) != alone
    assert len(set(alone)) > 3  # the row really is random, not collapsed to one token


def assert_support(samples: torch.Tensor, expected: set[int]) -> None:
    assert set(samples.tolist()) == expected


@pytest.mark.parametrize("kernels", KERNELS)
def test_top_k_keeps_exactly_k_tokens(kernels):
    needs_cpp(kernels)
    logits = torch.linspace(2.0, 0.0, 20)[torch.randperm(20)]  # [vocab], all likely
    top5 = set(logits.topk(5).indices.tolist())
    assert_support(sample_many(logits, SamplingParams(top_k=5), 4000, kernels), top5)
    # top_k beside top_p takes the sort path; top_p = 0.999 keeps all of the top 5.
    both = sample_many(logits, SamplingParams(top_k=5, top_p=0.999), 4000, kernels)
    assert_support(both, top5)
    assert len(set(sample_many(logits, SamplingParams(), 4000, kernels).tolist())) == 20
    # Rows without top_k in the batch: the full-vocabulary sort ("torch"), or each group
    # its own way ("cpp")
    params = [SamplingParams(top_k=5 - i % 2, top_p=0.999 if i % 3 else 1.0) for i in range(3000)]
    params += [SamplingParams(top_p=0.999)] * 3000
    rows = [make_row(p) for p in params]
    out = Sampler(kernels)(logits.expand(6000, -1), rows).sampled_token_ids
    top4 = set(logits.topk(4).indices.tolist())
    assert_support(torch.tensor(out[0:3000:2]), top5)
    assert_support(torch.tensor(out[1:3000:2]), top4)
    assert_support(torch.tensor(out[3000:]), set(range(20)))


@pytest.mark.parametrize("kernels", KERNELS)
def test_top_p_keeps_the_nucleus(kernels):
    needs_cpp(kernels)
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    logits = logits_from_probs(probs)
    # Sorted: 0.4, 0.3 | 0.15, ...: 0.4 < 0.65 <= 0.7, so the nucleus is {1, 3}.
    samples = sample_many(logits, SamplingParams(top_p=0.65), 6000, kernels)
    assert_support(samples, {1, 3})
    assert (samples == 1).float().mean().item() == pytest.approx(0.4 / 0.7, abs=0.03)
    # 0.4 + 0.3 + 0.15 = 0.85 >= 0.8: three tokens.
    assert_support(sample_many(logits, SamplingParams(top_p=0.8), 6000, kernels), {1, 3, 4})
    assert_support(sample_many(logits, SamplingParams(top_p=0.1), 500, kernels), {1})


def test_cpp_top_p_and_min_p_keep_what_torch_keeps():
    """The C++ draw's nucleus (a histogram of the weights, no sort) against torch's sort, on
    3,000 tokens from peaked to flat: what uniforms spread over [0, 1) draw is the kept set
    (every kept token of probability above 5 / num_draws, none outside it)."""
    needs_cpp("cpp")
    from llmserve.kernels import cpu as cpu_kernels

    vocab, num = 3000, 100_000
    u = (torch.arange(num) + 0.5) / num  # evenly over [0, 1)
    for spread, top_p, min_p, temperature in (
        (6.0, 0.9, 0.0, 1.0),
        (2.0, 0.95, 0.0, 0.7),
        (0.5, 0.5, 0.0, 1.3),
        (3.0, 1.0, 0.02, 1.0),
        (3.0, 0.99, 0.05, 1.0),
    ):
        row = torch.randn(vocab) * spread
        row[::7] = -math.inf  # masked tokens: never kept
        kept = top_k_top_p_sorted(row[None] / temperature, None, torch.tensor([top_p]), vocab)
        probs = kept.softmax(dim=-1)[0]
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
        drawn = cpu_kernels.draw_rows(
            row.expand(num, -1).contiguous(),
            torch.full((num,), 1 / temperature),
            u,
            torch.full((num,), top_p),
            torch.full((num,), min_p),
        )
        counts = torch.bincount(drawn, minlength=vocab)
        assert set(counts.nonzero().flatten().tolist()) <= set(probs.nonzero().flatten().tolist())
        assert set((probs > 5 / num).nonzero().flatten().tolist()) <= set(drawn.tolist())
        assert (counts / num - probs).abs().max() < 1e-3  # the inverse CDF, exactly spread


@pytest.mark.parametrize("kernels", KERNELS)
def test_rows_with_a_top_k_draw_from_the_full_pipelines_distribution(kernels):
    """Every row with a top_k: the draw among each row's best logits (the same on either
    ``kernels``) follows the distribution of the whole-vocabulary pipeline
    (``sampling_probs``)."""
    needs_cpp(kernels)
    logits = torch.randn(60) * 2
    params = SamplingParams(temperature=0.7, top_k=12, top_p=0.8, min_p=0.1)
    expected = sampling_probs(logits[None], [make_row(params)])[0]
    expected = expected / expected.sum()
    samples = sample_many(logits, params, 40000, kernels)
    freqs = torch.bincount(samples, minlength=60).float() / 40000
    assert set(samples.tolist()) == set(expected.nonzero().flatten().tolist())
    assert (freqs - expected).abs().max() < 0.015


def test_top_p_among_the_best_logits_keeps_what_a_full_sort_keeps():
    """Nuclei within the best 256 logits, within 4,096, and past them (a full sort), beside
    rows with a top_k or with neither knob: the same tokens kept, with the same logits."""
    vocab = 10_000
    spread = torch.tensor([8.0, 8.0, 2.5, 2.5, 0.3, 0.3, 8.0, 2.5, 0.3, 1.0])  # peaked .. flat
    logits = torch.randn(10, vocab) * spread[:, None]
    top_p = torch.tensor([0.9, 0.99, 0.9, 0.99, 0.9, 0.5, math.inf, 0.95, 0.95, math.inf])
    top_k = torch.tensor([vocab, vocab, vocab, vocab, vocab, vocab, 40, 300, 6000, vocab])
    full = top_k_top_p_sorted(logits, top_k, top_p, vocab)
    kept = apply_top_k_top_p(logits, top_k, top_p, vocab)
    assert torch.equal(kept, full)
    kept_sizes = full.isfinite().sum(dim=-1).tolist()
    assert min(kept_sizes[:6]) < 256 and any(256 < n < 4096 for n in kept_sizes[:6])
    assert any(n > 4096 for n in kept_sizes[:6]) and kept_sizes[9] == vocab
    assert torch.equal(
        apply_top_k_top_p(logits, None, top_p, vocab),
        top_k_top_p_sorted(logits, None, top_p, vocab),
    )


@pytest.mark.parametrize("kernels", KERNELS)
def test_min_p_drops_unlikely_tokens(kernels):
    needs_cpp(kernels)
    logits = logits_from_probs([0.05, 0.5, 0.15, 0.3])
    # Threshold 0.2 * 0.5 = 0.1: token 0 (0.05) goes, token 2 (0.15) stays.
    assert_support(sample_many(logits, SamplingParams(min_p=0.2), 4000, kernels), {1, 2, 3})
    assert_support(sample_many(logits, SamplingParams(min_p=0.5), 4000, kernels), {1, 3})


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature, kernels):
    needs_cpp(kernels)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    samples = sample_many(logits, SamplingParams(temperature=temperature), 20000, kernels)
    freqs = torch.bincount(samples, minlength=5).float() / 20000
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(freqs, expected, atol=0.015), (freqs, expected)
    if temperature != 1.0:
        assert not torch.allclose(freqs, torch.softmax(logits, dim=-1), atol=0.015)


def test_apply_penalties_matches_hand_computation():
    logits = torch.tensor(
        [
            [2.0, -1.0, 4.0, -3.0, 1.0, 0.5],
            [2.0, -1.0, 4.0, -3.0, 1.0, 0.5],
            [2.0, -1.0, 4.0, -3.0, 1.0, 0.5],
        ]
    )
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0, 1], [0, 1], [5]],
        output_token_ids=[[2, 2, 3], [2, 2, 3], [1, 1, 1]],
        repetition_penalties=[2.0, 1.0, 1.0],
        presence_penalties=[0.0, 0.5, 0.0],
        frequency_penalties=[0.0, 0.25, -1.0],
    )
    expected = torch.tensor(
        [
            # repetition 2 on prompt {0, 1} and output {2, 3}: +/2, -*2; 4 and 5 untouched.
            [1.0, -2.0, 2.0, -6.0, 1.0, 0.5],
            # output only: token 2 (count 2) -0.5-0.5, token 3 (count 1) -0.5-0.25.
            [2.0, -1.0, 3.0, -3.75, 1.0, 0.5],
            # frequency -1 raises token 1 (count 3) by 3; the prompt plays no part.
            [2.0, 2.0, 4.0, -3.0, 1.0, 0.5],
        ]
    )
    assert torch.equal(out, expected)


def test_apply_penalties_matches_dense_counts():
    """The sparse update against the formulas on whole [rows, vocab] count tables, with
    repeated tokens, an empty output and tokens seen in both the prompt and the output."""
    vocab = 500
    logits = torch.randn(4, vocab) * 3
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (40, 0, 7, 300)]
    outputs = [torch.randint(0, 60, (n,)).tolist() for n in (25, 9, 0, 120)]
    rep, pres, freq = [1.3, 1.0, 0.8, 1.1], [0.0, 0.7, 0.2, -0.4], [0.5, 0.0, 0.1, 0.3]

    def counts(ids_per_row):
        return torch.stack([torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
                            for ids in ids_per_row]).float()  # fmt: skip

    out_counts = counts(outputs)
    seen = (counts(prompts) + out_counts) > 0
    penalty = torch.where(seen, torch.tensor(rep)[:, None], 1.0)
    expected = torch.where(logits > 0, logits / penalty, logits * penalty)
    expected = expected - torch.tensor(pres)[:, None] * (out_counts > 0)
    expected = expected - torch.tensor(freq)[:, None] * out_counts
    before = logits.clone()
    out = apply_penalties(logits, prompts, outputs, rep, pres, freq)
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, before)  # out of place


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0]])
    plain = make_row(SamplingParams(temperature=0.0), output_token_ids=[0])
    rep = make_row(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt_token_ids=[0])
    pres = make_row(SamplingParams(temperature=0.0, presence_penalty=0.2), output_token_ids=[0])
    batch = torch.cat([logits, logits, logits])  # [3, vocab]
    assert Sampler()(batch, [plain, rep, pres]).sampled_token_ids == [0, 1, 1]


def test_logit_bias_forces_a_token():
    logits = torch.randn(4, 300)  # [rows, vocab]
    biased = {123: 100.0, 5000: 50.0}  # an id outside the vocabulary is ignored
    params = [
        SamplingParams(temperature=0.0, logit_bias=biased),
        SamplingParams(temperature=1.0, logit_bias=biased),
        SamplingParams(temperature=1.0, top_k=3, logit_bias=biased),
        SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    out = Sampler()(logits, [make_row(p) for p in params])
    assert out.sampled_token_ids[:3] == [123, 123, 123]
    assert out.sampled_token_ids[3] == int(logits[3].topk(2).indices[1])


@pytest.mark.parametrize("kernels", KERNELS)
def test_allowed_token_ids_limit_each_row_to_its_set(kernels):
    """Greedy rows take the best allowed token, random rows draw only allowed ones, in the
    allowed tokens' own proportions; rows without a set are untouched."""
    needs_cpp(kernels)
    logits = torch.randn(300)  # [vocab]
    allowed = [7, 8, 250]
    best = max(allowed, key=lambda t: float(logits[t]))
    rows = [
        make_row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
        make_row(SamplingParams(temperature=0.0)),
        *[make_row(SamplingParams(temperature=1.0, allowed_token_ids=allowed))] * 3000,
    ]
    out = Sampler(kernels)(logits.expand(len(rows), -1), rows).sampled_token_ids
    assert out[0] == best and out[1] == int(logits.argmax())
    drawn = torch.tensor(out[2:])
    assert set(drawn.tolist()) <= set(allowed)
    want = torch.softmax(logits[allowed], dim=0)
    got = torch.stack([(drawn == t).float().mean() for t in allowed])
    torch.testing.assert_close(got, want, atol=0.04, rtol=0)


def test_bad_words_mask_the_token_that_would_complete_them():
    """A one-token word is never drawn; a longer one only loses its last token where the output
    ends with the rest (read in place from the sequence, drafts included)."""
    logits = torch.zeros(5, 20)
    logits[:, 9] = 5.0  # the best token everywhere
    logits[:, 7] = 4.0
    words = [[9], [5, 6, 7]]  # "9" alone; "5 6 7"
    params = SamplingParams(temperature=0.0, bad_words_token_ids=words)
    rows = [
        make_row(params, output_token_ids=[1, 2]),  # 9 banned: 7 next
        make_row(SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6, 9]]), [4, 5, 6]),
        make_row(SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6, 9]]), [6, 5]),
        make_row(params, output_token_ids=OutputTokens([0, 0, 5], 1, [6])),  # 9 and 7 banned
        make_row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, rows).sampled_token_ids
    assert out == [7, 7, 9, 0, 9]
    assert OutputTokens([0, 1, 2, 3], 1, [4, 5]).tail(3) == [3, 4, 5]
    assert OutputTokens([0, 1, 2, 3], 1, [4, 5]).tail(9) == [1, 2, 3, 4, 5]
    assert OutputTokens([0, 1, 2], 2).tail(1) == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 8.0, 1.0]])  # eos 1, then stop id 2, then 3
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    sampler = Sampler()
    short = make_row(params, output_token_ids=[4, 4], eos_token_id=1)
    done = make_row(params, output_token_ids=[4, 4, 4], eos_token_id=1)
    random_short = [make_row(SamplingParams(min_tokens=1), eos_token_id=1) for _ in range(200)]
    out = sampler(logits.expand(202, -1), [short, done, *random_short]).sampled_token_ids
    assert out[:2] == [3, 1]
    assert 1 not in out[2:] and 2 in out[2:]  # eos masked, stop id 2 not: no stop_token_ids


def test_sampled_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, 50)  # [rows, vocab]
    params = [
        SamplingParams(temperature=0.3, logprobs=3, presence_penalty=2.0, logit_bias={7: 30.0}),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=None),
        SamplingParams(temperature=0.0, logprobs=60, logit_bias={9: 100.0}),
    ]
    out = Sampler()(logits, [make_row(p, output_token_ids=[1, 2]) for p in params])
    reference = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    sampled = out.sampled_token_ids
    assert sampled[0] == 7 and sampled[3] == 9
    top3 = set(reference[0].topk(3).indices.tolist())
    assert set(out.logprobs[0]) == top3 | {7}
    assert set(out.logprobs[1]) == {sampled[1]}
    assert out.logprobs[2] is None
    assert len(out.logprobs[3]) == 50  # logprobs beyond the vocabulary: all of it
    for row in (0, 1, 3):
        for token_id, logprob in out.logprobs[row].items():
            assert logprob == pytest.approx(reference[row, token_id].item(), abs=1e-5)


def test_top_logprobs_rank_each_token_as_vllm_does():
    """The top entries rank 1..N in order; the asked-for token one more than the tokens with a
    higher logprob (so ties share a rank), whether or not it is among the top."""
    from llmserve.runner.logprobs import top_logprobs

    logits = torch.tensor([[3.0, 1.0, 2.0, 1.5, 0.0], [0.0, 5.0, 4.0, 3.0, 2.0]])
    rows = top_logprobs(logits, torch.tensor([4, 2]), [2, 1])
    assert {t: lp.rank for t, lp in rows[0].items()} == {0: 1, 2: 2, 4: 5}
    assert {t: lp.rank for t, lp in rows[1].items()} == {1: 1, 2: 2}
    want = torch.log_softmax(logits, dim=-1)
    assert rows[0][4].logprob == pytest.approx(float(want[0, 4]))
    tied = top_logprobs(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), torch.tensor([2]), [1])[0]
    assert tied[2].rank == 2  # tokens 1 and 2 tie behind token 0


def test_compute_prompt_logprobs_matches_reference():
    logits = torch.randn(7, 40).to(torch.bfloat16)  # [prompt positions, vocab]
    targets = [3, 3, 39, 0, 12, 5, 21]
    result = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    reference = torch.log_softmax(logits.float(), dim=-1)  # [positions, vocab]
    assert len(result) == 7
    for i, entry in enumerate(result):
        expected_ids = set(reference[i].topk(2).indices.tolist()) | {targets[i]}
        assert set(entry) == expected_ids
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(reference[i, token_id].item(), abs=1e-5)
    only_targets = compute_prompt_logprobs(logits, targets, num_logprobs=0)
    assert [list(entry) for entry in only_targets] == [[t] for t in targets]
    assert not math.isnan(sum(v for e in only_targets for v in e.values()))


def test_greedy_takes_the_first_of_tied_maxima_as_argmax():
    logits = torch.randn(6, 1000)
    logits[:, ::5] = logits[:, ::5].round()  # many equal values
    logits[0, [3, 700]] = 50.0  # a tie at the maximum: the first index wins
    logits[1, [999, 2]] = 50.0
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert greedy(logits)[:2].tolist() == [3, 2]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_reads_the_argmax_and_distributions_of_each_row(kernels, dtype):
    """``argmax_and_probs`` (drafting and verifying): raw logits where no stage acts, the
    penalized ones where a row has a bias; the same argmax and distribution either way."""
    needs_cpp(kernels)
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 3).to(dtype)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.0),
    ]
    wide = logits.float()
    for biased in (False, True):
        rows = [make_row(p) for p in params]
        if biased:  # one row's bias makes every row go through the fp32 copy
            rows[2] = make_row(SamplingParams(temperature=0.0, logit_bias={7: 100.0}))
        argmax, random_rows, probs = argmax_and_probs(logits, rows, kernels)
        want = wide.argmax(dim=-1)
        if biased:
            want[2] = 7
        assert argmax == want.tolist()
        assert random_rows == [1, 3, 4]
        assert probs.dtype == torch.float32
        want_probs = sampling_probs(wide[random_rows], [rows[i] for i in random_rows])
        want_probs = want_probs / want_probs.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(probs, want_probs)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert argmax_and_probs(logits[:2], rows, kernels)[1:] == ([], None)


def test_output_tokens_read_the_sequence_in_place():
    """A row's output tokens are a view of its sequence's token list (no copy a step); the
    drafts after them are fixed when the row is made, though the drafter's list grows."""
    token_ids, drafts = [5, 6, 7, 8], [40]
    view = OutputTokens(token_ids, 2, drafts)
    drafts.append(41)  # the drafter's next draft: not this row's
    assert len(view) == 3 and list(view) == [7, 8, 40] and view[1] == 8 and view[-1] == 40
    token_ids.append(9)  # the sequence grew (a later step): the view follows it
    assert list(view) == [7, 8, 9, 40] and len(view) == 4
    assert len(OutputTokens(token_ids, 5)) == 0 and list(OutputTokens(token_ids, 5)) == []


def test_penalties_on_a_view_equal_those_on_a_list():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    params = SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.3)
    rows = [make_row(params, [3, 3, 9], [1, 2]), make_row(params, [7], [4])]
    views = [
        SamplingRow(params, [1, 2], OutputTokens([1, 2, 3, 3, 9], 2), None, None),
        SamplingRow(params, [4], OutputTokens([4, 7], 1), None, None),
    ]
    penalized = penalized_logits(logits, rows)
    assert not torch.equal(penalized, logits)  # the penalties act
    assert torch.equal(penalized_logits(logits, views), penalized)
