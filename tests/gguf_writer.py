"""Write a Hugging Face model to GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does, for
the loader's tests: its metadata keys, gguf-py's own tensor-name map, and its layout changes
(llama q/k rows interleaved, Gemma norms stored as 1 + w, GPT-2's Conv1D transposed, fused qkv
rows regrouped for Bloom / GPT-NeoX / Falcon, experts stacked), with a tiny byte-level
tokenizer so that llmserve can open the file on its own.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import torch
import transformers as T

from llmserve.loader.hf_loader import iter_hf_tensors

ARCH = {  # HF model_type -> llama.cpp architecture
    "gemma": "gemma",
    "gemma2": "gemma2",
    "phi3": "phi3",
    "gpt2": "gpt2",
    "gpt_bigcode": "starcoder",
    "gptj": "gptj",
    "falcon": "falcon",
    "gpt_neox": "gptneox",
    "bloom": "bloom",
    "phi": "phi2",
    "qwen3_moe": "qwen3moe",
    "mpt": "mpt",
    "mixtral": "llama",
    "llama": "llama",
}


def write_gguf(
    path: str,
    hf_dir: str,
    qtype: gguf.GGMLQuantizationType | None = None,
    vocabulary: dict[str, Any] | None = None,
) -> None:
    """Convert the fp32 checkpoint saved in ``hf_dir`` to a GGUF file at ``path``; with
    ``qtype``, every matrix but the position table and the MoE router in ``qtype``'s blocks
    (as llama-quantize); with ``vocabulary`` (``read_vocabulary``), that tokenizer instead of the byte-level toy."""
    config = T.AutoConfig.from_pretrained(hf_dir)
    arch = ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    for key, value in _metadata(config).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_vocab_size(config.vocab_size)
    if vocabulary is not None:
        assert len(vocabulary["tokens"]) == config.vocab_size
        _add_vocabulary(writer, vocabulary)
    else:
        if getattr(config, "pad_token_id", None) is not None:
            writer.add_pad_token_id(config.pad_token_id)
        _add_tokenizer(writer, config.vocab_size)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in _converted(dict(iter_hf_tensors(hf_dir)), config, arch):
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = tensor.contiguous().numpy()
        if qtype is not None and array.ndim in (2, 3) and not _kept_float(gguf_name):
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _kept_float(gguf_name: str) -> bool:
    """What llama-quantize leaves unquantized among matrices: the position table and the
    MoE router (``ffn_gate_inp``); stacked experts (3-D) are quantized like any matrix."""
    return "position_embd" in gguf_name or "ffn_gate_inp" in gguf_name


def _metadata(c: Any) -> dict[str, Any]:
    """As each converter's ``set_gguf_parameters`` (``add_<key>`` -> value)."""
    if c.model_type in ("gpt2", "gpt_bigcode", "gptj"):
        return _gpt_metadata(c, c.model_type)
    if c.model_type in ("bloom", "falcon", "mpt"):
        return _layer_norm_metadata(c, c.model_type)
    return _rotary_metadata(c, c.model_type)


def _gpt_metadata(c: Any, t: str) -> dict[str, Any]:
    meta = dict(
        context_length=c.n_positions,
        embedding_length=c.n_embd,
        feed_forward_length=4 * c.n_embd,
        head_count=c.n_head,
        layer_norm_eps=c.layer_norm_epsilon,
    )
    if t == "gptj" and c.rotary_dim < c.n_embd // c.n_head:
        meta |= dict(rope_dimension_count=c.rotary_dim)
    return meta | ({"head_count_kv": 1} if t == "gpt_bigcode" else {})


def _layer_norm_metadata(c: Any, t: str) -> dict[str, Any]:
    meta = dict(
        context_length=2048,
        embedding_length=c.hidden_size,
        feed_forward_length=4 * c.hidden_size,
        head_count=c.num_attention_heads,
        layer_norm_eps=c.layer_norm_epsilon,
    )
    if t == "falcon":  # the converter reads num_kv_heads only; 7B has one kv head
        kv = c.num_kv_heads if c.new_decoder_architecture else 1 if c.multi_query else None
        meta |= dict(head_count_kv=kv or c.num_attention_heads, tensor_data_layout="jploski")
    if t == "mpt":
        meta |= dict(max_alibi_bias=float(c.attn_config.alibi_bias_max))
    return meta


def _rotary_metadata(c: Any, t: str) -> dict[str, Any]:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = dict(
        context_length=c.max_position_embeddings,
        embedding_length=c.hidden_size,
        feed_forward_length=c.intermediate_size,
        head_count=c.num_attention_heads,
        head_count_kv=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
    )
    if t == "gpt_neox":
        return meta | dict(
            rope_dimension_count=int(_rotary(c) * head_dim),
            parallel_residual=c.use_parallel_residual,
            layer_norm_eps=c.layer_norm_eps,
        )
    if t == "phi":
        return meta | dict(
            feed_forward_length=4 * c.hidden_size,
            rope_dimension_count=int(_rotary(c) * c.hidden_size) // c.num_attention_heads,
            layer_norm_eps=c.layer_norm_eps,
        )
    return meta | dict(layer_norm_rms_eps=c.rms_norm_eps) | _rms_norm_extras(c, t, head_dim)


def _rms_norm_extras(c: Any, t: str, head_dim: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if t in ("gemma", "gemma2"):
        meta |= dict(key_length=head_dim, value_length=head_dim)
    if t == "gemma2":
        meta |= dict(
            attn_logit_softcapping=c.attn_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping,
            sliding_window=c.sliding_window,
        )
    if t == "phi3":
        meta |= dict(
            rope_dimension_count=int(_rotary(c) * head_dim),
            rope_freq_base=c.rope_parameters["rope_theta"],
            rope_scaling_orig_ctx_len=c.original_max_position_embeddings,
            sliding_window=c.sliding_window or 0,
        )
    if t in ("qwen3_moe", "mixtral"):
        meta |= dict(
            rope_freq_base=c.rope_parameters["rope_theta"],
            expert_used_count=c.num_experts_per_tok,
        )
    if t == "qwen3_moe":
        meta |= dict(
            key_length=head_dim,
            value_length=head_dim,
            expert_count=c.num_experts,
            expert_feed_forward_length=c.moe_intermediate_size,
            expert_weights_norm=c.norm_topk_prob,
        )
    if t == "mixtral":
        meta |= dict(expert_count=c.num_local_experts)
    return meta


def _rotary(c: Any) -> float:
    rope = getattr(c, "rope_parameters", None) or {}
    return rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary without merges: 256 byte tokens, then filler."""
    tokens = [chr(b) if 33 <= b <= 126 else chr(256 + b) for b in range(256)]
    tokens += [f"<t{i}>" for i in range(vocab_size - 256)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)


# tokenizer.ggml.<key> / tokenizer.<key> -> GGUFWriter method
_VOCABULARY_KEYS = {
    "model": "add_tokenizer_model",
    "pre": "add_tokenizer_pre",
    "tokens": "add_token_list",
    "token_type": "add_token_types",
    "scores": "add_token_scores",
    "merges": "add_token_merges",
    "bos_token_id": "add_bos_token_id",
    "eos_token_id": "add_eos_token_id",
    "unknown_token_id": "add_unk_token_id",
    "padding_token_id": "add_pad_token_id",
    "add_bos_token": "add_add_bos_token",
    "add_eos_token": "add_add_eos_token",
    "add_space_prefix": "add_add_space_prefix",
    "chat_template": "add_chat_template",
}


def _add_vocabulary(writer: gguf.GGUFWriter, vocabulary: dict[str, Any]) -> None:
    for key, method in _VOCABULARY_KEYS.items():
        if vocabulary.get(key) is not None:
            getattr(writer, method)(vocabulary[key])


def read_vocabulary(path: str) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, keys as in ``_VOCABULARY_KEYS``."""
    from llmserve.loader.gguf_file import GGUFFile  # gguf.GGUFReader: 30 s over 262k tokens

    fields = GGUFFile(path).fields
    return {
        key.removeprefix("tokenizer.").removeprefix("ggml."): entry.contents()
        for key, entry in fields.items()
        if key.startswith("tokenizer.")
    }


def cut_bpe_vocabulary(vocabulary: dict[str, Any], size: int) -> dict[str, Any]:
    """A byte-level BPE vocabulary cut to its first ``size`` tokens, keeping the merges whose
    parts and result all survive: it still spells any text (down to single bytes), and readers
    of the file (gguf-py's takes seconds per 49k tokens) go through it quickly."""
    kept = set(vocabulary["tokens"][:size])
    merges = [m for m in vocabulary["merges"] if {*m.split(" "), m.replace(" ", "")} <= kept]
    cut = {k: v[:size] if k in ("tokens", "token_type", "scores") and v else v
           for k, v in vocabulary.items()}  # fmt: skip
    return {**cut, "merges": merges}


def _converted(state: dict[str, torch.Tensor], c: Any, arch: str):
    """(HF-style name gguf-py maps, tensor in llama.cpp's layout), as the converter yields."""
    if arch == "gemma" or arch == "gemma2":
        state.pop("lm_head.weight", None)
    if arch in ("gpt2", "bloom"):  # the converter writes the tied head out
        embed = "transformer.wte.weight" if arch == "gpt2" else "transformer.word_embeddings.weight"
        state.setdefault("lm_head.weight", state[embed])
    experts: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        if re.search(r"\.attn\.(bias|masked_bias)$|rotary_emb", name):
            continue
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match:  # stacked per layer and projection, in expert order
            experts.setdefault(f"{match[1]}.{match[3]}.weight", []).append(tensor)
            continue
        if arch == "bloom":
            name = name.removeprefix("transformer.")
        yield name, _layout(name, tensor.float(), c, arch)
    for name, tensors in experts.items():
        yield name, torch.stack(tensors)  # [num_experts, out, in]


def _layout(name: str, t: torch.Tensor, c: Any, arch: str) -> torch.Tensor:
    if arch == "llama" and re.search(r"self_attn\.[qk]_proj", name):
        heads = c.num_attention_heads if ".q_proj" in name else c.num_key_value_heads
        return _llama_permute(t, heads)
    if arch in ("gemma", "gemma2") and name.endswith("norm.weight"):
        return t + 1
    if arch == "gpt2" and re.search(r"(c_attn|c_proj|c_fc)\.weight$", name):
        return t.t()
    if "query_key_value" in name:
        heads = c.num_attention_heads
        kv = heads
        if arch == "falcon":
            kv = c.num_kv_heads if c.new_decoder_architecture else 1 if c.multi_query else heads
        return _jploski(t, heads, kv)
    return t


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _jploski(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Falcon's qkv transform (Bloom's and GPT-NeoX's is the case kv_heads == heads):
    per kv group [q.., k, v] rows -> [all q | all k | all v]."""
    head_dim = w.shape[0] // (heads + 2 * kv_heads)
    qkv = w.reshape(kv_heads, heads // kv_heads + 2, head_dim, *w.shape[1:])
    q = qkv[:, :-2].reshape(heads * head_dim, *w.shape[1:])
    k = qkv[:, [-2]].reshape(kv_heads * head_dim, *w.shape[1:])
    v = qkv[:, [-1]].reshape(kv_heads * head_dim, *w.shape[1:])
    return torch.cat((q, k, v))
