"""Load the tokenizer of a resolved model (from a GGUF file's metadata or an HF directory).

Building a fast tokenizer from a GGUF file's metadata takes seconds (7.6 s for the default
model on a 2-core host), so the result is saved once under the cache root and read from
there (0.25 s) as long as the file is the same one: ``$LLMSERVE_CACHE_ROOT``, else
``$XDG_CACHE_HOME/llmserve``, else ``~/.cache/llmserve`` (``tokenizers/<key>``).
"""

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from llmserve.loader import ResolvedModel, resolve_model
from llmserve.loader.gguf_loader import load_gguf_config

logger = logging.getLogger(__name__)


# apply_chat_template's own arguments: chat_template_kwargs (LLM.chat's, the server's) may not
# set them
TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


def reserved_template_kwargs(kwargs: dict[str, Any] | None) -> list[str]:
    """The names in ``kwargs`` (chat_template_kwargs) that only the templating call may set."""
    return sorted(set(kwargs or ()) & TEMPLATE_ARGUMENTS)


def get_tokenizer(
    model: ResolvedModel | str | None = None,
    *,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """Return the transformers tokenizer of `model` (a ResolvedModel, a path, or None for the
    default model), with the chat template the model ships, if any.

    Only local files are read (`local_files_only=True`), so nothing is ever downloaded.
    For GGUF models the end-of-sequence token is the file's `tokenizer.ggml.eos_token_id`
    (for SmolLM2: id 2, "<|im_end|>").
    """
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    if resolved.kind == "gguf":
        tokenizer = _gguf_tokenizer(resolved, trust_remote_code)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            resolved.path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    if resolved.kind == "gguf":
        _set_gguf_special_tokens(tokenizer, resolved)
        if tokenizer.chat_template is None:
            tokenizer.chat_template = _default_chat_template(resolved)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def engine_tokenizer(
    resolved: ResolvedModel, tokenizer: str | None, vocab_size: int, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    """The tokenizer an engine runs with: the model's own, or ``tokenizer`` (a directory or
    GGUF file, vLLM's ``--tokenizer``), which must not hold more tokens than the model's
    vocabulary (``vocab_size``) has rows."""
    if tokenizer is None:
        return get_tokenizer(resolved, trust_remote_code=trust_remote_code)
    path = Path(tokenizer)
    if path.is_dir() and not any(path.glob("*.gguf")):  # tokenizer files alone will do
        loaded = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        if loaded.pad_token_id is None and loaded.eos_token_id is not None:
            loaded.pad_token = loaded.eos_token
    else:
        loaded = get_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    if len(loaded) > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer!r} has {len(loaded)} tokens but the model's vocabulary has "
            f"{vocab_size}: it is not this model's tokenizer"
        )
    return loaded


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Any
) -> tuple[str | None, list[int]]:
    """(text, token ids) of an engine prompt: text, token ids, or ``{"prompt": ...}`` /
    ``{"prompt_token_ids": ...}``; text is encoded with the tokenizer's special tokens."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    return None, list(prompt)


def cache_root() -> Path:
    """Where llmserve keeps what it derives from model files (see the module docstring)."""
    root = os.environ.get("LLMSERVE_CACHE_ROOT")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve"


@functools.cache
def _builder_digest() -> str:
    """A digest of the code that builds GGUF tokenizers (this file and
    ``loader/gguf_tokenizer.py``): a change to it invalidates every cache entry."""
    from llmserve.loader import gguf_tokenizer

    sources = (Path(__file__), Path(gguf_tokenizer.__file__))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


def _cached_tokenizer_dir(weights_path: str) -> Path:
    """The cache entry of a GGUF file's tokenizer: keyed by the file (real path, size, time of
    its last change), the versions of transformers and tokenizers, and the building code."""
    stat = os.stat(weights_path)
    ident = "|".join(
        str(x)
        for x in (
            os.path.realpath(weights_path),
            stat.st_size,
            stat.st_mtime_ns,
            transformers.__version__,
            tokenizers.__version__,
            _builder_digest(),
        )
    )
    return cache_root() / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:32]


def _gguf_tokenizer(resolved: ResolvedModel, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer from the cache, else built (``_build_gguf_tokenizer``) and saved
    there; a cache that cannot be read or written only costs the build."""
    entry = _cached_tokenizer_dir(resolved.weights_path)
    if entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged entry is rebuilt
            logger.warning("tokenizer cache entry %s unreadable (%s); rebuilding it", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = _build_gguf_tokenizer(resolved, trust_remote_code)
    staging = None
    try:  # written beside the entry, then renamed into place: readers never see half of it
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=entry.parent, prefix=".staging-")
        tokenizer.save_pretrained(staging)
        os.rename(staging, entry)
    except OSError as exc:  # read-only home, or another process saved it first
        logger.debug("tokenizer of %s not cached: %s", resolved.weights_path, exc)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _build_gguf_tokenizer(
    resolved: ResolvedModel, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of a GGUF file, or, where it builds none (architectures it has
    no config for: gemma, gptj, gptneox, starcoder, phi2, mpt, ...), one built from the file's
    tokenizer metadata (``loader/gguf_tokenizer.py``)."""
    try:
        return AutoTokenizer.from_pretrained(
            resolved.path,
            gguf_file=resolved.gguf_file,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:  # noqa: BLE001 - any failure of transformers' conversion
        from llmserve.loader.gguf_loader import gguf_architecture, gguf_reader
        from llmserve.loader.gguf_tokenizer import build_gguf_tokenizer

        logger.info(
            "%s: tokenizer built from the GGUF metadata (transformers: %s)",
            resolved.display_name,
            exc,
        )
        path = resolved.weights_path
        return build_gguf_tokenizer(gguf_reader(path), gguf_architecture(path))


def _default_chat_template(resolved: ResolvedModel) -> str | None:
    """The family's own template for a GGUF file that carries none (see chat_templates.py)."""
    from llmserve.loader.chat_templates import DEFAULT_CHAT_TEMPLATES
    from llmserve.loader.gguf_loader import gguf_architecture

    return DEFAULT_CHAT_TEMPLATES.get(gguf_architecture(resolved.weights_path))


def _set_gguf_special_tokens(tokenizer: PreTrainedTokenizerBase, resolved: ResolvedModel) -> None:
    """Make eos/bos follow the ids in the GGUF metadata."""
    config = load_gguf_config(resolved.weights_path)
    for attr in ("eos", "bos"):
        token_id = getattr(config, f"{attr}_token_id", None)
        if token_id is not None and getattr(tokenizer, f"{attr}_token_id") != token_id:
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(token_id))
