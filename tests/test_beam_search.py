"""Beam search inside the engine, on the default model, against transformers' own beam search."""

from __future__ import annotations

import httpx
import pytest
import torch

from llmserve import LLM, BeamSearchParams, SamplingParams
from tests.conftest import assert_no_leaks
from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
WIDTH, LENGTH = 4, 8


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf_beams(llm, hf_default_model):
    """transformers: generate(num_beams=4, num_return_sequences=4), EOS blocked for 8 tokens."""
    model = hf_default_model
    tokenizer = llm.get_tokenizer()
    results = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids, num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
            max_new_tokens=LENGTH, min_new_tokens=LENGTH, attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id, output_scores=True, return_dict_in_generate=True,
            length_penalty=1.0, early_stopping=False,
        )  # fmt: skip
        results.append(
            [
                (seq[ids.shape[1] :].tolist(), score.item())
                for seq, score in zip(out.sequences, out.sequences_scores)
            ]
        )
    return results


def test_equals_transformers(llm, hf_beams):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=LENGTH, ignore_eos=True)
    outputs = llm.beam_search(PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    for out, reference, prompt in zip(outputs, hf_beams, PROMPTS):
        prompt_len = len(tokenizer.encode(prompt))
        ours = [(s.tokens[prompt_len:], s.score) for s in out.sequences]
        assert [t for t, _ in ours] == [t for t, _ in reference]
        for (_, score), (_, ref_score) in zip(ours, reference):
            assert score == pytest.approx(ref_score, abs=2e-3)
        assert out.sequences[0].text == tokenizer.decode(out.sequences[0].tokens[prompt_len:])
    assert_no_leaks(llm)


def test_beams_share_kv_blocks(llm):
    """Peak KV blocks of one width-4 search against four independent sequences."""
    engine = llm.llm_engine
    bm = engine.block_manager
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[1] * 6)  # a few blocks of prompt
    engine.add_request("beams", {"prompt_token_ids": prompt_ids}, SamplingParams(
        n=WIDTH, temperature=0.0, max_tokens=24, ignore_eos=True, use_beam_search=True))  # fmt: skip
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)  # blocks referenced now
    independent = WIDTH * bm.num_blocks_for(len(prompt_ids) + 24)
    print(f"width-4 beam search: peak {peak} KV blocks; 4 independent sequences: {independent}")
    assert peak <= 0.6 * independent  # the prompt and common prefixes are held once
    assert_no_leaks(llm)


def test_eos_and_length_penalty(llm):
    """Beams may end at EOS: results are ranked by their length-penalized score."""
    for penalty in (0.0, 1.0, 2.0):
        params = BeamSearchParams(beam_width=3, max_tokens=24, length_penalty=penalty)
        (out,) = llm.beam_search(["Say hi."], params)
        scores = [s.score for s in out.sequences]
        assert len(out.sequences) == 3 and scores == sorted(scores, reverse=True)
        prompt_len = len(llm.get_tokenizer().encode("Say hi."))
        for s in out.sequences:
            generated = len(s.tokens) - prompt_len
            assert s.score == pytest.approx(s.cum_logprob / generated**penalty)
            assert s.finish_reason in ("stop", "length")
    assert_no_leaks(llm)


def test_mixed_with_sampling_requests(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    beams = SamplingParams(n=WIDTH, temperature=0.0, max_tokens=8, ignore_eos=True, use_beam_search=True)  # fmt: skip
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy, beams], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert len(mixed[1].outputs) == WIDTH


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5), "temperature"),
        (
            lambda: SamplingParams(n=2, use_beam_search=True, temperature=0.0, stop=["x"]),
            "stop strings",
        ),  # fmt: skip
    ],
)
def test_bad_params(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_width_beyond_the_engine(llm):
    with pytest.raises(ValueError, match=r"beam width 9 .* \(--max-num-seqs\)"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=9, max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests()


def test_completions_api(llm):
    server = ServerProcess(*SMALL_SERVER_ARGS)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": LENGTH, "ignore_eos": True,
                "use_beam_search": True, "beam_width": 3}  # fmt: skip
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        offline = llm.beam_search(PROMPTS[:1], BeamSearchParams(3, LENGTH, ignore_eos=True))[0]
        assert [c["text"] for c in reply["choices"]] == [s.text for s in offline.sequences]
        bad = httpx.post(
            f"{server.url}/v1/completions", json=body | {"stop": ["x"]}, timeout=60
        )  # beam search ranks greedy log-probabilities: no stop strings
        assert bad.status_code == 400 and "stop strings" in bad.json()["error"]["message"]
    finally:
        server.close()
