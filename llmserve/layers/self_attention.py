"""The attention block every family wires: fused q|k|v projection, optional per-head q/k norms,
a position scheme (RoPE, ALiBi or none: absolute positions were added at the embedding), the
paged ``Attention`` core, and the output projection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import Attention, KVCache
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.layernorm import kernels_for, make_norm
from llmserve.layers.module import Module
from llmserve.layers.position import Rope


@dataclass
class RopeConfig:
    """Rotary on the first ``rotary_dim`` channels of each head."""

    rotary_dim: int
    params: dict[str, Any]  # rope_theta, rope_type and its scaling keys (see rotary.py)
    max_position: int
    is_neox: bool = True  # pairs are split halves (else adjacent channels, GPT-J)


@dataclass
class AttentionConfig:
    """One layer's attention; a family builds one per layer (bases and windows may differ)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    scale: float | None = None  # default head_dim ** -0.5
    rope: RopeConfig | None = None
    alibi_slopes: torch.Tensor | None = None  # [num_heads]
    sliding_window: int | None = None
    softcap: float | None = None
    qk_norm: str | None = None  # "rms" or "gemma_rms": per head, before RoPE
    qk_norm_eps: float = 1e-6


def shared_rope(
    cfg: AttentionConfig, max_model_len: int, cache: dict[str, Rope] | None, kernels: str
) -> Rope:
    """One ``Rope`` module (and cos/sin table) per distinct RoPE config, shared by the layers."""
    r = cfg.rope
    assert r is not None
    key = repr((cfg.head_dim, r.rotary_dim, sorted(r.params.items()), r.max_position, r.is_neox))
    if cache is not None and key in cache:
        return cache[key]
    rope = Rope(
        cfg.head_dim, r.rotary_dim, r.params, r.max_position, max_model_len, r.is_neox, kernels
    )
    if cache is not None:
        cache[key] = rope
    return rope


class SelfAttention(Module):
    """``qkv_proj`` rows: q (``num_heads * head_dim``), then k, then v (``num_kv_heads * head_dim``)."""

    def __init__(
        self,
        cfg: AttentionConfig,
        max_model_len: int,
        backend: str,
        rope_cache: dict[str, Rope] | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        width = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.out_bias)
        self.q_norm = self.k_norm = None
        kernels = kernels_for(backend)
        if cfg.qk_norm is not None:
            self.q_norm = make_norm(cfg.qk_norm, cfg.head_dim, cfg.qk_norm_eps, kernels=kernels)
            self.k_norm = make_norm(cfg.qk_norm, cfg.head_dim, cfg.qk_norm_eps, kernels=kernels)
        self.rotary = (
            None if cfg.rope is None else shared_rope(cfg, max_model_len, rope_cache, kernels)
        )
        scale = cfg.head_dim**-0.5 if cfg.scale is None else cfg.scale
        self.attn = Attention(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            scale,
            backend,
            sliding_window=cfg.sliding_window,
            softcap=cfg.softcap,
            alibi_slopes=cfg.alibi_slopes,
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
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)  # [T, H * D]
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, meta)
        return self.o_proj(out if keep is None else out[keep])
