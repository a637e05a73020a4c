"""Perplexity evaluation: the window arithmetic, the text split, and the engine's numbers
against transformers on the same weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from quantization.tiny_llama import save_tiny_llama

from llmserve.entrypoints.cli import main
from llmserve.eval import text_source
from llmserve.eval.perplexity import perplexity, windows


@pytest.mark.parametrize(
    "num_tokens, window, stride", [(10, 4, 2), (10, 4, 4), (9, 9, 3), (3, 8, 4)]
)
def test_windows_score_every_token_but_the_first_once(num_tokens, window, stride):
    spans = windows(num_tokens, window, stride)
    scored = [p for _, end, first in spans for p in range(first, end)]
    assert scored == list(range(1, num_tokens))
    for begin, end, first in spans:
        assert end - begin <= window and begin <= first < end


@pytest.mark.parametrize("window, stride", [(1, 1), (8, 0), (8, 9)])
def test_bad_windows_are_refused(window, stride):
    with pytest.raises(ValueError, match="allowed: window >= 2 and 1 <= stride <= window"):
        windows(100, window, stride)


def test_pydoc_split_is_deterministic_and_disjoint():
    text = text_source.pydoc_text()
    calibration = text_source.read_text("pydoc", "calibration")
    evaluation = text_source.read_text("pydoc", "evaluation")
    assert calibration + evaluation == text
    assert abs(len(calibration) - len(text) / 2) < 5000 and calibration.endswith("\n")
    assert evaluation == text_source.read_text("pydoc", "evaluation")


def test_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert text_source.read_text(str(tmp_path / "a.jsonl"), "evaluation") == "one\n\ntwo"
    (tmp_path / "b.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match='b.jsonl line 1: expected an object with a string "text"'):
        text_source.read_text(str(tmp_path / "b.jsonl"), "evaluation")
    (tmp_path / "c.csv").write_text("x")
    with pytest.raises(ValueError, match="must end in .txt or .jsonl"):
        text_source.read_text(str(tmp_path / "c.csv"), "evaluation")


class FakeLLM:
    """Every prompt token has log p = -log(vocab): the perplexity must be ``vocab``."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.num_prompts = 0

    def generate(self, prompts, params):
        from llmserve.outputs import RequestOutput

        assert params.prompt_logprobs == 0 and params.max_tokens == 1
        self.num_prompts += len(prompts)
        logp = -math.log(self.vocab)
        return [
            RequestOutput(
                "r",
                None,
                p["prompt_token_ids"],
                [],
                True,
                prompt_logprobs=[None] + [{t: logp} for t in p["prompt_token_ids"][1:]],
            )
            for p in prompts
        ]


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    llm = FakeLLM(vocab=50)
    result = perplexity(llm, list(range(100)), window=16, stride=8)
    assert result.num_tokens == 99 and result.num_windows == llm.num_prompts == 12
    assert result.perplexity == pytest.approx(50.0)


@pytest.fixture(scope="module")
def tiny_float_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ppl_model"))
    model, tokenizer = save_tiny_llama(path, tie_word_embeddings=False)
    with torch.no_grad():  # a peaked, not uniform, next-token distribution
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    return path, model, tokenizer


def hf_perplexity(model, token_ids, window, stride, shift: int = 1) -> float:
    nll, count = 0.0, 0
    for begin, end, first in windows(len(token_ids), window, stride):
        ids = torch.tensor([token_ids[begin:end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, vocab]
        for position in range(first, end):
            nll -= float(logprobs[position - begin - shift, token_ids[position]])
            count += 1
    return math.exp(nll / count)


def test_cli_perplexity_matches_transformers(tiny_float_model, tmp_path, capsys):
    path, model, tokenizer = tiny_float_model
    text = tmp_path / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    args = ["eval", "perplexity", "--model", path, "--dataset", str(text), "--window", "64"]
    assert main([*args, "--stride", "32", "--max-tokens", "150", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    token_ids = tokenizer(text.read_text())["input_ids"][:150]
    assert report["num_tokens"] == 149 and report["num_windows"] == 4
    expected = hf_perplexity(model, token_ids, 64, 32)
    assert report["perplexity"] == pytest.approx(expected, rel=1e-3)
    misaligned = hf_perplexity(model, token_ids, 64, 32, shift=2)  # each token's wrong logits
    assert abs(math.log(misaligned) - math.log(expected)) > 0.1


def test_cli_refuses_a_missing_dataset(tiny_float_model, capsys):
    path, _, _ = tiny_float_model
    assert main(["eval", "perplexity", "--model", path, "--dataset", "/no/such.txt"]) == 2
    assert "does not exist; give 'pydoc'" in capsys.readouterr().err
