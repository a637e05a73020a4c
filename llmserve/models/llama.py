"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): our own implementation.

Projections are fused: ``qkv_proj`` holds q, k and v rows; ``gate_up_proj`` holds gate and up.
Optional q/k/v bias (Qwen2), tied or separate LM head, any ``num_key_value_heads`` (GQA/MQA),
sliding-window layers (Mistral's ``sliding_window``, Qwen2's ``layer_types``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmserve.layers.activation import SiluAndMul
from llmserve.layers.attention import Attention, KVCache
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.module import Module
from llmserve.layers.rotary import RotaryEmbedding, rope_parameters, to_interleaved
from llmserve.models.decoder_spec import layer_windows


class LlamaAttention(Module):
    def __init__(
        self, config: Any, max_model_len: int, backend: str, sliding_window: int | None = None
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            rope_parameters(config),
            config.max_position_embeddings,
            max_model_len,
            backend,
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            backend,
            sliding_window=sliding_window,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``, or only the rows ``keep`` past attention."""
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        if self.rotary_emb.interleaved:
            qk = self.rotary_emb.forward_interleaved(
                positions, qkv[:, : self.q_size + self.kv_size]
            )
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        else:
            q, k = (
                qkv[:, : self.q_size].contiguous(),
                qkv[:, self.q_size : self.q_size + self.kv_size].contiguous(),
            )
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out if keep is None else out[keep])


class LlamaMLP(Module):
    def __init__(self, config: Any, kernels: str):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(Module):
    def __init__(
        self, config: Any, max_model_len: int, backend: str, sliding_window: int | None = None
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, max_model_len, backend, sliding_window)
        self.mlp = LlamaMLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(
        self, positions, x, residual, kv_cache: KVCache, meta: AttentionMetadata, keep=None
    ):
        """``keep``: the rows to finish past attention (the last layer's output rows)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, keep)
        if keep is not None:
            residual = residual[keep]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(Module):
    """Decoder stack plus LM head; ``forward`` returns hidden states, ``compute_logits`` logits."""

    # Hugging Face name fragment -> (our parameter fragment, shard index) for fused weights.
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, max_model_len: int, attention_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, max_model_len, attention_backend, window)
            for window in layer_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attention_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> hidden states ``[T, hidden]`` (``[num_outputs,
        hidden]`` where ``meta.output_rows`` names the rows wanted)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            keep = meta.output_rows if i == last else None
            x, residual = layer(positions, x, residual, kv_cache, meta, keep)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, hidden]`` at the positions that sample -> ``[N, vocab]``."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}"
                )
            self._copy_shard(params[target], tensor, shard, target)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {sorted(missing)[:8]}")

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """Our parameter for a checkpoint name (``model.`` removed), and its shard if fused."""
        for hf_part, (ours, shard) in self.FUSED.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard
        return name, None

    def quantized_placement(
        self, hf_name: str, num_rows: int
    ) -> tuple[str, int | None, torch.Tensor | None]:
        """(our parameter, shard, stored row order) of a quantized checkpoint weight."""
        target, shard = self.checkpoint_target(hf_name.removeprefix("model."))
        return target, shard, self.shard_row_order(target, shard, num_rows)

    def _copy_shard(
        self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str
    ) -> None:
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                return
            sizes = self.shard_sizes(name)
            start = sum(sizes[:shard])
            order = self.shard_row_order(name, shard, tensor.shape[0])
            param[start : start + sizes[shard]].copy_(tensor if order is None else tensor[order])

    def shard_row_order(self, name: str, shard: int | None, rows: int) -> torch.Tensor | None:
        """The row order this model stores a checkpoint shard in (None: as it comes): q/k rows
        interleave per head when the rotary kernel is the pairwise one (see RotaryEmbedding)."""
        attn = self.layers[0].self_attn
        if "qkv_proj" in name and shard is not None and shard < 2 and attn.rotary_emb.interleaved:
            return to_interleaved(torch.arange(rows), attn.head_dim)
        return None

    def shard_sizes(self, name: str) -> list[int]:
        """Rows of each checkpoint part of a fused parameter (q, k, v or gate, up)."""
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2
