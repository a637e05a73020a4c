"""One decoder layer of a Llama-family model (Llama, Mistral, Qwen2, Qwen3: with per-head q/k
RMSNorms before the rotary), run in the stages whose outputs are the inputs of its linear
layers, over all calibration sequences at once:

    h ──input_layernorm──> x_attn ──q,k,v + rope + causal attention──> heads ──o_proj──┐
    h ───────────────────────────────────────────────────────────────────────(+)<─────┘= h2
    h2 ─post_attention_layernorm─> x_mlp ──act(gate) * up──> hidden ──down_proj──(+ h2)──> out

Running stage by stage lets GPTQ quantize q/k/v before computing the heads from their
quantized outputs, then o_proj, and so on (AutoGPTQ's true-sequential order) in a single pass.
The weights live in a transformers model; every stage reads its modules' current weights.
Sequences are processed ``CHUNK`` at a time to bound the temporary memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 8  # calibration sequences per matmul batch

# Linear layers of one decoder layer, grouped by shared input, in the order they are reached.
LINEAR_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def chunked(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``CHUNK`` sequences at a time (dim 0), results concatenated."""
    with torch.no_grad():
        parts = [
            fn(*(t[i : i + CHUNK] for t in tensors)) for i in range(0, tensors[0].shape[0], CHUNK)
        ]
    return torch.cat(parts)


class DecoderStages:
    """The stages of ``layer`` (a transformers ``LlamaDecoderLayer`` or alike) for sequences
    whose rotary ``cos, sin [1, T, head_dim]`` are given."""

    def __init__(self, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor):
        self.layer = layer
        self.cos, self.sin = cos, sin
        attn = layer.self_attn
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim

    def attention_input(self, h: torch.Tensor) -> torch.Tensor:
        """``h [S, T, hidden]`` -> ``x_attn [S, T, hidden]``."""
        return chunked(self.layer.input_layernorm, h)

    def attention_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x_attn [S, T, hidden]`` -> attention output before o_proj ``[S, T, heads * hd]``."""
        return chunked(self._heads, x)

    def attention_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x_attn`` -> the attention block's output ``[S, T, hidden]``."""
        return chunked(lambda c: self.layer.self_attn.o_proj(self._heads(c)), x)

    def mlp_input(self, h: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, heads)`` -> ``(h2, x_mlp)``: the residual after attention, and its norm."""
        h2 = chunked(lambda a, b: a + self.layer.self_attn.o_proj(b), h, heads)
        return h2, chunked(self.layer.post_attention_layernorm, h2)

    def mlp_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``x_mlp [S, T, hidden]`` -> ``act(gate(x)) * up(x) [S, T, intermediate]``."""
        return chunked(self._hidden, x)

    def mlp_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x_mlp`` -> the MLP's output ``[S, T, hidden]``."""
        return chunked(lambda c: self.layer.mlp.down_proj(self._hidden(c)), x)

    def layer_output(self, h2: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``h2 + down_proj(hidden)``: the layer's output, the next layer's ``h``."""
        return chunked(lambda a, b: a + self.layer.mlp.down_proj(b), h2, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The whole layer: ``h [S, T, hidden]`` -> output ``[S, T, hidden]``."""
        h2, x_mlp = self.mlp_input(h, self.attention_heads(self.attention_input(h)))
        return self.layer_output(h2, self.mlp_hidden(x_mlp))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.layer.self_attn
        s, t, _ = x.shape
        q = attn.q_proj(x).view(s, t, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(s, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's dimensions
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(s, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, self.cos, self.sin)  # [S, heads, T, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )  # [S, heads, T, hd]
        return out.transpose(1, 2).reshape(s, t, self.num_heads * self.head_dim)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layer.mlp
        return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def rotary_tables(model: nn.Module, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [1, T, head_dim]`` of positions 0..T-1 from the model's rotary embedding."""
    positions = torch.arange(seq_len)[None]  # [1, T]
    probe = torch.zeros(1, seq_len, 1, dtype=torch.float32)
    with torch.no_grad():
        return model.model.rotary_emb(probe, positions)
