"""Tokenizer loading and incremental detokenization with the default SmolLM2 tokenizer."""

import os

import pytest

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.loader import default_model_path
from llmserve.tokenizer import get_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = {
    "english": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "korean": "안녕하세요, 세계!",
    "emoji": "🎉👍🏽 ok",
    "mixed": "Café: 日本語, 한국어 and 🧑‍🚀 in one line.\nNext line.",
}


@pytest.fixture(scope="module")
def tokenizer():
    """Loaded from a path string: resolve_model and the GGUF tokenizer path both run."""
    return get_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def chat_prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Say hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text)


def _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detokenizer.append(token_id) for token_id in output_ids]
    assert detokenizer.output_text == "".join(deltas)
    return deltas


def test_default_tokenizer_special_tokens_and_chat_template(tokenizer) -> None:
    assert (tokenizer.eos_token_id, tokenizer.eos_token) == (2, "<|im_end|>")
    assert tokenizer.bos_token_id == 1
    assert tokenizer.pad_token_id is not None
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("name", list(TEXTS))
def test_deltas_concatenate_to_full_decode(tokenizer, chat_prompt_ids, name: str) -> None:
    output_ids = tokenizer.encode(TEXTS[name])
    for prompt_ids in (chat_prompt_ids, []):
        deltas = _stream(tokenizer, prompt_ids, output_ids)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True)
        assert "".join(deltas) == TEXTS[name]
        assert not any(delta.endswith("\ufffd") for delta in deltas)


def test_multibyte_characters_span_several_tokens(tokenizer) -> None:
    """The case the hold-back logic exists for: some tokens are fragments of a character."""
    output_ids = tokenizer.encode(TEXTS["korean"] + TEXTS["emoji"])
    fragments = [i for i in output_ids if "\ufffd" in tokenizer.decode([i])]
    assert fragments, "test text no longer splits characters across tokens"
    deltas = _stream(tokenizer, [], output_ids)
    assert "" in deltas and "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, chat_prompt_ids, skip_special_tokens: bool) -> None:
    output_ids = tokenizer.encode("Hi there!<|im_end|>\n<|im_start|>user\n안녕")
    deltas = _stream(tokenizer, chat_prompt_ids, output_ids, skip_special_tokens)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_finish_flushes_an_incomplete_character(tokenizer) -> None:
    output_ids = tokenizer.encode("ok 🎉")
    truncated = output_ids[:-1]  # the emoji's last byte never arrives
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detokenizer.append(token_id) for token_id in truncated)
    assert streamed == "ok"
    tail = detokenizer.finish()
    assert streamed + tail == tokenizer.decode(truncated)
    assert tail.endswith("\ufffd") and detokenizer.output_text == streamed + tail
    assert detokenizer.finish() == ""


def test_window_stays_small(tokenizer) -> None:
    """Work per token is bounded: the decoded window never grows with the output length."""
    output_ids = tokenizer.encode(" ".join([TEXTS["english"], TEXTS["korean"]] * 50))
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    max_window = 0
    for token_id in output_ids:
        detokenizer.append(token_id)
        max_window = max(max_window, len(detokenizer.token_ids) - detokenizer.prefix_offset)
    assert detokenizer.output_text == tokenizer.decode(output_ids)
    assert max_window <= 8
