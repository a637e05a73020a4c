"""GGUF tokenizers built from the file's own metadata (``llmserve/loader/gguf_tokenizer.py``),
for the architectures whose tokenizer transformers does not build. Real vocabularies, offline:
the default model's byte-level BPE (SmolLM2, 49152 tokens) in tiny gptj / gptneox / starcoder /
phi2 / mpt files, and Gemma 3's SentencePiece vocabulary (its first 8000 tokens: controls,
user-defined, byte and normal ones) in tiny gemma files. Every file must encode and decode as
the tokenizer transformers builds from the original file does, special tokens whole."""

from __future__ import annotations

import os

# as in test_model_families.py: set before llmserve imports triton, whichever file runs first
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import AutoTokenizer

from llmserve.loader.gguf_loader import gguf_reader
from llmserve.loader.gguf_tokenizer import build_gguf_tokenizer
from llmserve.tokenizer import get_tokenizer
from tests.test_model_families_gguf import tiny_gguf

TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "The year 2024 had 366 days; 3.14159 != 22/7.",
    "naïve café, ünïcödé, 日本語のテキスト, emoji 🤖🚀",
    "tabs\tand\n\nnewlines\n   indented    spaces",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares",
    "It's we've they'll I'd don't",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "",
    "   ",
]
GPT2_TYPE = ["gptj", "gptneox", "starcoder", "phi2", "mpt"]


def assert_same_tokenizer(ours, reference, same_size: bool = True) -> None:
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        ), text
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert len(ours) == len(reference) or not same_size


@pytest.mark.parametrize("name", GPT2_TYPE)
def test_byte_level_bpe_from_metadata(name, tmp_path, request):
    """The first family reads the default model's whole vocabulary (49,152 tokens, its
    reference from the default model's file); the others its cut (conftest)."""
    whole = name == GPT2_TYPE[0]
    vocabulary = request.getfixturevalue("smollm_vocabulary" if whole else "smollm_cut_vocabulary")
    reference = request.getfixturevalue("smollm_reference" if whole else "smollm_cut_reference")
    # the references come from Llama files of the same vocabulary: transformers builds none of
    # these families' tokenizers from a GGUF file ("not supported")
    path, _ = tiny_gguf(tmp_path, name, vocabulary)
    for ours in (get_tokenizer(path), get_tokenizer(path)):  # built, then from the cache
        assert_same_tokenizer(ours, reference)
        assert len(ours) == len(vocabulary["tokens"])
        assert ours.pad_token_id == vocabulary["padding_token_id"]
        assert ours.chat_template == reference.chat_template
        assert ours.encode("<|im_start|>") == [1]  # a control token stays whole


def test_sentencepiece_from_metadata(gemma_reference):
    path, reference = gemma_reference
    ours = build_gguf_tokenizer(gguf_reader(path), "gemma2")
    assert_same_tokenizer(ours, reference)
    assert ours.encode("hi")[0] == ours.bos_token_id  # add_bos_token
    assert ours.encode("<start_of_turn>")[1:] == [ours.convert_tokens_to_ids("<start_of_turn>")]


def sentencepiece_vocabulary(smollm_vocabulary: dict, add_space_prefix: bool) -> dict:
    """A SentencePiece-style vocabulary without any package: SmolLM2's normal tokens spelled
    back to text with U+2581 for spaces, ranked by their merge order, after Gemma-named
    control tokens and the 256 byte tokens."""
    from llmserve.loader.gguf_tokenizer import _byte_alphabet

    byte_of = {char: byte for byte, char in _byte_alphabet().items()}
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    seen = set(tokens)
    for token, kind in zip(smollm_vocabulary["tokens"], smollm_vocabulary["token_type"]):
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if kind == 1 and text not in seen and len(tokens) < 16384:
            seen.add(text)
            tokens.append(text)
    fixed = len(specials) + 256
    return dict(
        model="llama",
        pre="default",
        tokens=tokens,
        token_type=[3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * (len(tokens) - fixed),
        scores=[0.0] * fixed + [-float(i) for i in range(len(tokens) - fixed)],
        bos_token_id=2,
        eos_token_id=1,
        unknown_token_id=3,
        padding_token_id=0,
        add_bos_token=True,
        add_space_prefix=add_space_prefix,
    )


@pytest.mark.parametrize(
    "family, arch, add_space_prefix",
    [("mixtral", "llama", True), ("gemma2", "gemma2", False)],  # scores / token order
)
def test_sentencepiece_without_the_gemma_package(
    family, arch, add_space_prefix, tmp_path, smollm_vocabulary
):
    """Both SentencePiece flavours against transformers on files it reads (llama, gemma2)."""
    vocabulary = sentencepiece_vocabulary(smollm_vocabulary, add_space_prefix)
    path, _ = tiny_gguf(tmp_path, family, vocabulary)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    ours = build_gguf_tokenizer(gguf_reader(path), arch)
    # transformers' classes add their default special tokens (<s>, <mask>) past the vocabulary
    assert_same_tokenizer(ours, reference, same_size=False)
    assert len(ours) == len(vocabulary["tokens"])
    for text in (" Hello", "a  b", "\u2581x", "Hi<end_of_turn>\nthere"):
        assert ours.encode(text) == reference.encode(text), text


def test_gemma_file_opens_with_its_vocabulary(gemma_vocabulary, gemma_reference, tmp_path):
    """A ``gemma`` file (transformers builds no tokenizer for it): llmserve's own, and Gemma's
    chat template from llmserve's table (the file has none)."""
    path, _ = tiny_gguf(tmp_path, "gemma", gemma_vocabulary)
    ours = get_tokenizer(path)
    assert_same_tokenizer(ours, gemma_reference[1])
    chat = ours.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<start_of_turn>user\nHi<end_of_turn>" in chat


def test_unknown_tokenizer_model_is_refused(tmp_path, smollm_vocabulary):
    path, _ = tiny_gguf(tmp_path, "mpt", {**smollm_vocabulary, "model": "bert"})
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        build_gguf_tokenizer(gguf_reader(path), "mpt")


def test_bos_eos_flags_and_ids(tmp_path, smollm_cut_vocabulary):
    """add_bos_token / add_eos_token wrap every encoding (pairs too); pad and unk by id."""
    vocabulary = {**smollm_cut_vocabulary, "add_bos_token": True, "add_eos_token": True}
    vocabulary |= {"bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0}
    path, _ = tiny_gguf(tmp_path, "mpt", vocabulary)
    for ours in (get_tokenizer(path), get_tokenizer(path)):  # built, then from the cache
        ids = ours.encode("Hello world")
        assert ids[0] == 1 and ids[-1] == 2 and len(ids) > 2
        assert ours("a", "b")["input_ids"].count(1) == 2  # <bos> a <eos> <bos> b <eos>
        assert (ours.pad_token, ours.unk_token) == ("<|endoftext|>", "<|endoftext|>")
        assert ours.decode(ids, skip_special_tokens=True) == "Hello world"


def test_tokenizers_are_cached_per_file(
    tmp_path, monkeypatch, smollm_cut_vocabulary, smollm_cut_reference
):
    """The first load builds and saves the tokenizer under the cache root; the next one reads
    it without building; a damaged entry is rebuilt; a changed file or a changed builder has
    another entry."""
    import llmserve.tokenizer as tokenizer_module

    monkeypatch.setenv("LLMSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    path, _ = tiny_gguf(tmp_path, "gptj", smollm_cut_vocabulary)
    build = tokenizer_module._build_gguf_tokenizer
    built = []
    monkeypatch.setattr(
        tokenizer_module, "_build_gguf_tokenizer", lambda *a: built.append(a) or build(*a)
    )
    first = get_tokenizer(path)
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file() and len(built) == 1
    second = get_tokenizer(path)
    assert len(built) == 1  # read, not built
    for ours in (first, second):
        assert_same_tokenizer(ours, smollm_cut_reference)
    (entry / "tokenizer.json").write_text("{ not json")
    assert_same_tokenizer(get_tokenizer(path), smollm_cut_reference)
    assert len(built) == 2 and (entry / "tokenizer.json").read_text().startswith("{\n")
    assert tokenizer_module._cached_tokenizer_dir(path) == entry
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_module, "_builder_digest", lambda: "other code")
        assert tokenizer_module._cached_tokenizer_dir(path) != entry  # the builder changed
    assert tokenizer_module._cached_tokenizer_dir(path) == entry
    os.utime(path, ns=(0, 0))  # another file at the same path
    assert tokenizer_module._cached_tokenizer_dir(path) != entry
