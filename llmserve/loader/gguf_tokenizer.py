"""A tokenizer built from a GGUF file's own metadata (``tokenizer.*`` keys), for the files
whose tokenizer transformers does not build (it refuses architectures it has no config for:
gemma, gptj, gptneox, starcoder, phi2, mpt, ...).

    tokenizer.ggml.model = gpt2    byte-level BPE: ``tokens`` spelled in GPT-2's byte alphabet,
                                   ``merges`` ("a b", best first); text split by the regexes
                                   llama.cpp uses for ``tokenizer.ggml.pre``, then to bytes
    tokenizer.ggml.model = llama   SentencePiece BPE: ``tokens`` with ``scores``, bytes as
                                   <0xNN> tokens (byte fallback), spaces as U+2581 and one
                                   before the text if ``add_space_prefix`` (and it starts with
                                   none, as transformers' Metaspace); merges from the file, else
                                   rebuilt: every split of a token into two tokens, ranked by
                                   the token's score (Gemma files: by the token's position)
    token_type 3 (control)         special tokens, matched whole, skipped when decoding
    token_type 4 (user defined)    added tokens, matched whole
    bos/eos/unknown/padding ids, add_bos_token / add_eos_token, tokenizer.chat_template

The result is a transformers ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)
SPACE = "\u2581"  # SentencePiece's visible space

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp (llama-vocab.cpp) splits text with, in turn;
# any other name: GPT-2's.
PRE_TOKENIZER_REGEXES = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), [_LLAMA3]),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), [_QWEN2]),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        [r"\p{N}", _GPT2],
    ),
}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def build_gguf_tokenizer(reader: Any, architecture: str) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file describes; ``reader`` is an open ``gguf.GGUFReader``."""
    meta = _tokenizer_metadata(reader)
    kind = meta.get("model")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, by_position=architecture in GEMMA_ARCHITECTURES)
    else:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: gpt2 byte-level "
            "BPE, llama SentencePiece BPE)"
        )
    _add_special_tokens(backend, meta)
    return _wrap(backend, meta)


def _tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """``tokenizer.ggml.tokens`` -> ``tokens`` etc., and ``chat_template``."""
    meta: dict[str, Any] = {}
    for key, entry in reader.fields.items():
        if key.startswith("tokenizer.ggml."):
            meta[key.removeprefix("tokenizer.ggml.")] = entry.contents()
    template = reader.fields.get("tokenizer.chat_template")
    meta["chat_template"] = None if template is None else template.contents()
    if "tokens" not in meta:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file has no tokenizer")
    return meta


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    """GPT-2-style BPE; a token outside the byte alphabet is respelled from its UTF-8 bytes."""
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    types = meta.get("token_type") or [1] * len(meta["tokens"])
    vocab = {}
    for index, (token, kind) in enumerate(zip(meta["tokens"], types)):
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= letters:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    regexes = PRE_TOKENIZER_REGEXES.get(meta.get("pre"), [_GPT2])
    tokenizer.pre_tokenizer = pre.Sequence(
        [pre.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any], by_position: bool) -> Tokenizer:
    """SentencePiece BPE with byte fallback (llama.cpp's SPM tokenizer)."""
    tokens = list(meta["tokens"])
    if by_position:  # Gemma stores runs of spaces as spaces; its merges follow token order
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if meta.get("merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    else:
        ranks = range(len(tokens), 0, -1) if by_position else meta["scores"]
        merges = merges_from_ranks(vocab, dict(zip(tokens, ranks)))
    unk_id = meta.get("unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("add_space_prefix", not by_position):  # one U+2581 before the first piece
        tokenizer.pre_tokenizer = pre.Metaspace(SPACE, prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
        tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_ranks(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, the merge of the best-ranked token
    first (ties: the longer left part, then token order), as SentencePiece's BPE merges."""
    found = []
    for order, (token, score) in enumerate(rank.items()):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                key = (-score, -len(left), -len(right), order, vocab[left], vocab[right])
                found.append((key, left, right))
    found.sort(key=lambda item: item[0])
    return [(left, right) for _, left, right in found]


def _add_special_tokens(tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens: matched whole."""
    vocab = tokenizer.get_vocab()
    tokens, types = meta["tokens"], meta.get("token_type") or []
    special = [t for t, k in zip(tokens, types) if k == CONTROL and t in vocab]
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if meta.get(key) is not None and tokens[meta[key]] in vocab:
            special.append(tokens[meta[key]])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    added = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])


def _wrap(backend: Tokenizer, meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """The transformers tokenizer: special tokens by id, BOS/EOS added as the file says."""
    tokens = meta["tokens"]

    def token(key: str) -> str | None:
        index = meta.get(key)
        return None if index is None or index >= len(tokens) else tokens[index]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("add_bos_token", meta.get("model") == "llama")) and bos is not None
    add_eos = bool(meta.get("add_eos_token", False)) and eos is not None

    def template(part: str, type_id: int) -> list[str]:
        return [
            *([f"{bos}:{type_id}"] if add_bos else []),
            f"{part}:{type_id}",
            *([f"{eos}:{type_id}"] if add_eos else []),
        ]

    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(used)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=meta.get("chat_template"),
        clean_up_tokenization_spaces=False,
    )
