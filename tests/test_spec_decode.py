"""Speculative decoding: lossless greedy output, the distribution of sampled output, rollback
of rejected KV slots, every sampling option, metrics, and the errors of a bad config."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.loader import default_model_path
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram import propose_ngram
from tests.conftest import NUM_TOKENS, PROMPTS, assert_no_leaks
from tests.server_process import ServerProcess

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "gguf"}
# The same weights named as a separate drafter: its own KV pool, caught up every step.
SEPARATE_DRAFT = SELF_DRAFT | {"model": default_model_path()}
CONFIGS = [NGRAM, SELF_DRAFT, SEPARATE_DRAFT]
CONFIG_IDS = ["ngram", "self-draft-gguf", "separate-draft-gguf"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
SMALL = dict(kv_cache_memory=64 << 20, max_model_len=512)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---- the n-gram proposer ------------------------------------------------------------------
def test_ngram_takes_the_latest_occurrence_of_the_longest_suffix():
    tokens = [7, 1, 2, 3, 4, 5, 9, 2, 3, 8, 1, 2, 3]
    # "1 2 3" (n = 3) occurs at 1 and is preferred over the later "2 3" at 7.
    assert propose_ngram(tokens, 3, 1, 4) == [4, 5, 9]
    assert propose_ngram(tokens, 3, 1, 2) == [8, 1, 2]  # n <= 2: "2 3" latest at 7
    assert propose_ngram([5, 6, 7], 2, 1, 4) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 1], 5, 1, 4) == [2, 1]  # the continuation may be short
    assert propose_ngram([1, 2, 1], 2, 2, 4) == []  # min_n = 2: "2 1" never occurred before


# ---- greedy identity on the default model ----------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_greedy_equals_transformers_alone_and_batched(config, hf_greedy_reference):
    llm = LLM(speculative_config=config, **SMALL)
    alone = [_token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS[:4]]
    assert alone == hf_greedy_reference[:4]
    batched = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert batched == hf_greedy_reference
    # Second pass: prompts hit the prefix cache (blocks of both pools reused).
    hits = llm.llm_engine.block_manager.num_prefix_hits
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(again) == hf_greedy_reference
    assert llm.llm_engine.block_manager.num_prefix_hits > hits
    stats = llm.llm_engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_no_leaks(llm)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_greedy_under_preemption(config, hf_greedy_reference):
    # 16 blocks of 8 tokens for both pools: the longest request needs 9, so few fit at once
    # and drafted slots compete with other sequences' decodes.
    per_block = 46080 * 8 * (2 if "model" in config else 1)  # a separate drafter: two pools
    spec = config | {"disable_by_batch_size": 64}
    llm = LLM(
        kv_cache_memory=16 * per_block, block_size=8, max_model_len=80, speculative_config=spec
    )
    assert llm.llm_engine.block_manager.num_blocks == 16
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy_reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec_stats.num_drafts > 0
    assert_no_leaks(llm)


def test_rejected_slots_are_given_back_and_never_cached():
    llm = LLM(speculative_config=NGRAM, **SMALL)
    engine = llm.llm_engine
    prompt = "SELECT name, email FROM users WHERE users.id = 1; SELECT name, email FROM users WHERE"
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            # Exactly the blocks the computed tokens need (the next decode allocates its own).
            assert len(seq.block_ids) == bm.num_blocks_for(seq.num_computed_tokens)
            # Every cached block hashes tokens the sequence really has.
            assert len(seq.block_hashes) == seq.num_computed_tokens // bm.block_size
    stats = engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some were rejected
    assert_no_leaks(llm)


# ---- sampling options behave as without speculation ------------------------------------
def test_sampling_options_match_no_speculation():
    base, spec = (
        LLM(**SMALL),
        LLM(speculative_config=NGRAM | {"num_speculative_tokens": 5}, **SMALL),
    )
    prompt = "CREATE TABLE users (id INTEGER, name TEXT);\nSELECT name FROM users WHERE users.id ="
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=24, logit_bias={13: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[" FROM"], min_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=7),  # max_tokens cuts a verified step
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
    ]
    for params in cases:
        want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids, params
        assert got.text == want.text and got.finish_reason == want.finish_reason, params
        if params.logprobs is not None:
            assert len(got.logprobs) == len(got.token_ids)
            for g, w, token in zip(got.logprobs, want.logprobs, got.token_ids, strict=True):
                assert g.keys() == w.keys() and token in g
                assert all(math.isclose(g[t], w[t], abs_tol=1e-3) for t in g)
    assert spec.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_seeded_sampling_reproduces_and_n_works():
    llm = LLM(speculative_config=SELF_DRAFT, **SMALL)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1234, n=2)
    first = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    second = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(first, second, strict=True):
        assert len(a.outputs) == 2
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert all(len(o.token_ids) <= 20 for o in a.outputs)
    assert llm.llm_engine.spec_stats.num_drafts > 0
    assert_no_leaks(llm)


# ---- the sampled distribution is the target's ------------------------------------------
VOCAB = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so n-gram drafts exist
TEMPERATURE = 0.9
NUM_SAMPLES = 4000
NUM_GENERATED = 4  # K = 2 drafts verified after the first token, then a plain decode or one more
ALPHA = 1e-4  # significance level of each chi-square test (12 tests: 0.12% false alarms)


def _tiny(path, seed):
    from tests.quantization.tiny_llama import save_tiny_llama

    model, _ = save_tiny_llama(
        str(path), seed=seed, vocab_size=VOCAB, hidden_size=32, initializer_range=0.2
    )  # weights large enough for peaked distributions: uniform ones would hide errors
    return model


def _exact_marginals(model, top_k: int = 0) -> list[torch.Tensor]:
    """P(t_i) after PROMPT under softmax(logits / T) (cut to the top_k tokens if set) for each
    generated position i, summing over every history before it (VOCAB ** (i - 1) of them)."""
    probs = []
    histories, weights = torch.tensor([PROMPT]), torch.ones(1)
    with torch.no_grad():
        for _ in range(NUM_GENERATED):
            logits = model(histories).logits[:, -1].double()  # [num_histories, vocab]
            p = torch.softmax(logits / TEMPERATURE, dim=-1)
            if top_k:
                kth = p.topk(top_k, dim=-1).values[:, -1:]
                p = torch.where(p >= kth, p, 0.0)
                p = p / p.sum(-1, keepdim=True)
            p = p * weights[:, None]
            probs.append(p.sum(0))
            histories = torch.cat(
                [
                    histories.repeat_interleave(VOCAB, 0),
                    torch.arange(VOCAB).repeat(len(histories))[:, None],
                ],
                dim=1,
            )
            weights = p.reshape(-1)
    return probs


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 samples are pooled into one."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    statistic = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


@pytest.mark.parametrize(
    ("method", "top_k"), [("ngram", 0), ("draft_model", 0), ("draft_model", 5)]
)
def test_sampled_tokens_follow_the_target_distribution(method, top_k, tmp_path):
    target = _tiny(tmp_path / "target", seed=0)
    drafter = _tiny(tmp_path / "drafter", seed=1)  # a different model: q differs from p
    config = {"method": method, "num_speculative_tokens": 2, "disable_by_batch_size": 10_000}
    if method == "draft_model":
        config["model"] = str(tmp_path / "drafter")
    llm = LLM(
        model=str(tmp_path / "target"),
        speculative_config=config,
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        enable_prefix_caching=True,
    )
    params = SamplingParams(
        temperature=TEMPERATURE,
        top_k=top_k,
        max_tokens=NUM_GENERATED,
        ignore_eos=True,
        skip_special_tokens=False,
    )
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])  # [samples, generated]
    stats = llm.llm_engine.spec_stats
    # Later tokens came out of verified steps, with rejections among them.
    assert stats.num_drafts >= NUM_SAMPLES // 10
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    exact = _exact_marginals(target, top_k)
    wrong = _exact_marginals(drafter, top_k)
    for position in range(NUM_GENERATED):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        assert _chi_square_p_value(counts, exact[position]) > ALPHA, position
    # The test can tell distributions apart: the drafter's own marginals are rejected.
    counts = torch.bincount(tokens[:, 1], minlength=VOCAB)
    assert _chi_square_p_value(counts, wrong[1]) < 1e-6
    assert_no_leaks(llm)


# ---- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown key"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),
        ('{"method": "ngram", num_speculative_tokens: 2}', "not valid JSON"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "q3"},
            "quantization must be one of",
        ),
    ],
)
def test_bad_config_is_refused_before_any_work(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)
    with pytest.raises(ValueError, match=message):
        LLM(model="/nonexistent", speculative_config=config)  # fails before the model is looked up


def test_draft_model_must_match_the_target(tmp_path):
    from tests.quantization.tiny_llama import save_tiny_llama

    save_tiny_llama(str(tmp_path / "small_vocab"), vocab_size=300)
    config = {
        "method": "draft_model",
        "model": str(tmp_path / "small_vocab"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match=r"vocabulary of 300 tokens but the target's has 49152"):
        LLM(speculative_config=config, **SMALL)
    save_tiny_llama(str(tmp_path / "short"), max_position_embeddings=128)
    save_tiny_llama(str(tmp_path / "target"), max_position_embeddings=1024)
    config = {
        "method": "draft_model",
        "model": str(tmp_path / "short"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(
        ValueError, match=r"handles 128 positions but the target runs sequences of up to 1024"
    ):
        LLM(model=str(tmp_path / "target"), speculative_config=config)


def test_cli_reports_malformed_json():
    result = subprocess.run(
        [sys.executable, "-m", "llmserve.entrypoints.cli", "generate", "--prompt", "hi",
         "--speculative-config", '{"method": "ngram",'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--speculative-config is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr


# ---- the server ---------------------------------------------------------------------------
def test_server_counts_drafts_in_metrics():
    server = ServerProcess(
        "--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
        "--speculative-config", json.dumps(NGRAM),
    )  # fmt: skip
    try:
        prompt = "SELECT id, name FROM users WHERE users.id = 3; SELECT id, name FROM users WHERE"
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        metrics = server.metrics()
        drafts = metrics["llmserve:spec_decode_num_drafts_total"]
        drafted = metrics["llmserve:spec_decode_num_draft_tokens_total"]
        accepted = metrics["llmserve:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
        per_position = [v for k, v in metrics.items() if "accepted_tokens_per_pos_total" in k]
        assert sum(per_position) == accepted
        bad = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": -1}, timeout=30)
        assert bad.status_code == 400
    finally:
        server.close()
