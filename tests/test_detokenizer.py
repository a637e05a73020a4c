"""Tokenizer loading and incremental detokenization with the default SmolLM2 tokenizer: the
window detokenizer and the DecodeStream one give the same deltas."""

import os

import pytest

from llmserve.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    make_detokenizer,
)
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


@pytest.fixture(params=["window", "stream"])
def kind(request) -> str:
    return request.param


def _make(kind: str, tokenizer, prompt_ids, skip_special_tokens=True):
    if kind == "window":
        return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return StreamDetokenizer(tokenizer._tokenizer, prompt_ids, skip_special_tokens)


def _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True, kind="window"):
    detokenizer = _make(kind, tokenizer, prompt_ids, skip_special_tokens)
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
def test_deltas_concatenate_to_full_decode(tokenizer, chat_prompt_ids, kind, name: str) -> None:
    output_ids = tokenizer.encode(TEXTS[name])
    for prompt_ids in (chat_prompt_ids, []):
        deltas = _stream(tokenizer, prompt_ids, output_ids, kind=kind)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True)
        assert "".join(deltas) == TEXTS[name]
        assert not any(delta.endswith("\ufffd") for delta in deltas)


def test_multibyte_characters_span_several_tokens(tokenizer, kind) -> None:
    """The case the hold-back logic exists for: some tokens are fragments of a character."""
    output_ids = tokenizer.encode(TEXTS["korean"] + TEXTS["emoji"])
    fragments = [i for i in output_ids if "\ufffd" in tokenizer.decode([i])]
    assert fragments, "test text no longer splits characters across tokens"
    deltas = _stream(tokenizer, [], output_ids, kind=kind)
    assert "" in deltas and "\ufffd" not in "".join(deltas)


def test_both_detokenizers_give_the_same_deltas(tokenizer) -> None:
    """Token by token, not only in sum: a stream client sees the same events either way. The
    prompt ends with a Korean word whose characters span tokens, so the window's left context
    starts inside one."""
    prompt_ids = tokenizer.encode("Translate: " + TEXTS["korean"] * 3)
    output_ids = tokenizer.encode(" ".join(TEXTS.values()))
    window = _stream(tokenizer, prompt_ids, output_ids, kind="window")
    assert _stream(tokenizer, prompt_ids, output_ids, kind="stream") == window


def test_the_first_token_decodes_as_mid_text(tokenizer, kind) -> None:
    """With the prompt as left context the first output token keeps its leading space."""
    prompt_ids, output_ids = tokenizer.encode("Hello"), tokenizer.encode(" world")
    assert _stream(tokenizer, prompt_ids, output_ids, kind=kind)[0] == " world"


def test_make_detokenizer_picks_the_stream_for_a_fast_tokenizer(tokenizer) -> None:
    assert isinstance(make_detokenizer(tokenizer, [1, 2]), StreamDetokenizer)
    tokenizer.clean_up_tokenization_spaces = True  # decode() would change the backend's text
    try:
        assert isinstance(make_detokenizer(tokenizer, [1, 2]), IncrementalDetokenizer)
    finally:
        tokenizer.clean_up_tokenization_spaces = False


class _RefusingStream:
    """A DecodeStream that raises on its first step, as tokenizers does on a prefix it finds
    decoded otherwise ("Invalid prefix encountered"): rare, so made to happen here."""

    def __init__(self, stream):
        self.stream, self.refused = stream, False

    def step(self, backend, token_id):
        if not self.refused:
            self.refused = True
            raise Exception("Invalid prefix encountered")
        return self.stream.step(backend, token_id)


def test_stream_recovers_when_decode_stream_refuses_a_step(tokenizer, chat_prompt_ids) -> None:
    output_ids = tokenizer.encode(TEXTS["mixed"])
    detokenizer = StreamDetokenizer(tokenizer._tokenizer, chat_prompt_ids)
    detokenizer.stream = _RefusingStream(detokenizer.stream)
    text = "".join(detokenizer.append(i) for i in output_ids) + detokenizer.finish()
    assert detokenizer.stream.__class__.__name__ == "DecodeStream"  # a fresh one took over
    assert text == TEXTS["mixed"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, chat_prompt_ids, kind, skip_special_tokens: bool) -> None:
    output_ids = tokenizer.encode("Hi there!<|im_end|>\n<|im_start|>user\n안녕")
    deltas = _stream(tokenizer, chat_prompt_ids, output_ids, skip_special_tokens, kind)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_finish_flushes_an_incomplete_character(tokenizer, kind) -> None:
    output_ids = tokenizer.encode("ok 🎉")
    truncated = output_ids[:-1]  # the emoji's last byte never arrives
    detokenizer = _make(kind, tokenizer, [])
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


def test_stream_starts_without_context_when_priming_is_refused(
    tokenizer, chat_prompt_ids, monkeypatch
) -> None:
    """If DecodeStream refuses the prompt's last tokens, the detokenizer starts with a fresh
    stream (no left context) instead of failing the request (and the engine step with it)."""
    from llmserve.engine import detokenizer as module

    made = []

    def first_refuses(**kwargs):
        made.append(module_stream(**kwargs))
        return _RefusingStream(made[-1]) if len(made) == 1 else made[-1]

    module_stream = module.DecodeStream
    monkeypatch.setattr(module, "DecodeStream", first_refuses)
    output_ids = tokenizer.encode(TEXTS["english"])
    detokenizer = StreamDetokenizer(tokenizer._tokenizer, chat_prompt_ids)
    text = "".join(detokenizer.append(i) for i in output_ids) + detokenizer.finish()
    assert len(made) == 2 and text == TEXTS["english"]
