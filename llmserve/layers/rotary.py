"""Rotary position embedding (RoPE) with the scaling types Llama-family configs use.

Rotation is "neox" style (split halves), as in Hugging Face's Llama. The cache holds
``cos`` then ``sin`` for every position: ``cos_sin_cache: [max_positions, rotary_dim]``.
Supported ``rope_type``: default, linear, dynamic, llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.module import Module


def rope_parameters(config: Any) -> dict[str, Any]:
    """Merge old-style (``rope_theta`` + ``rope_scaling``) and new-style ``rope_parameters``."""
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def compute_inv_freq(
    params: dict[str, Any], dim: int, max_position: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` and the attention scaling of the rope type."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim  # [dim // 2]
    inv_freq = 1.0 / base**exponents
    factor = float(params.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        # NTK-aware base, fixed for the whole context (as vLLM); identical to the default
        # (and to Hugging Face) while the context stays within the trained length.
        if max_model_len <= max_position:
            return inv_freq, 1.0
        max_len = max_position * factor
        scaled_base = base * ((factor * max_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / scaled_base**exponents, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, params, max_position)
    if rope_type != "default":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; use default, linear, dynamic, llama3 or yarn"
        )
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    original = params.get("original_max_position_embeddings") or max_position
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * ramp + (1 / pos_freqs) * extrapolation_weight
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(Module):
    """Applies RoPE to q and k at the given positions.

    Two layouts of the head dimension, chosen at construction:
      * "neox" (Hugging Face's): rotation pairs are ``(x[i], x[i + D/2])``; used with Triton.
      * "interleaved": pairs are ``(x[2i], x[2i + 1])``, so RoPE is one complex multiply on the
        fused q|k slice. The model permutes the q/k projection rows at load time to this
        layout (``to_interleaved``); attention scores are unchanged, since q and k get the same
        permutation of the head dimension.
    """

    def __init__(
        self,
        head_dim: int,
        params: dict[str, Any],
        max_position: int,
        max_model_len: int,
        kernels: str = "torch",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.kernels = kernels
        self.interleaved = kernels != "triton"
        inv_freq, scaling = compute_inv_freq(params, head_dim, max_position, max_model_len)
        t = torch.arange(max(max_position, max_model_len), dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)
        # (cos, sin) pairs, real so that ``model.to(dtype)`` keeps them: [max_positions, D/2, 2]
        self.register_buffer(
            "cis",
            cache.float().view(-1, 2, head_dim // 2).transpose(1, 2).contiguous(),
            persistent=False,
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox layout: q ``[num_tokens, num_heads * head_dim]``, k likewise."""
        if self.kernels == "triton":
            from llmserve.kernels import rotary_embedding_

            rotary_embedding_(positions, q, k, self.cos_sin_cache)
            return q, k
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward_interleaved(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Interleaved layout: ``qk: [T, (H + kvh) * D]`` (a view is fine) -> rotated, contiguous."""
        if self.kernels == "cpp":  # float32 or bfloat16 (resolve_attention_backend)
            return cpu_kernels.rotary_interleaved(qk, positions, self.cis, self.head_dim)
        num_tokens = qk.shape[0]
        pairs = qk.float().view(num_tokens, -1, self.head_dim // 2, 2)  # [T, heads, D/2, 2]
        cis = torch.view_as_complex(self.cis[positions].float()).unsqueeze(1)  # [T, 1, D/2]
        rotated = torch.view_as_complex(pairs) * cis
        return torch.view_as_real(rotated).view(num_tokens, -1).to(qk.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)  # [T, heads, D]
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.view(shape)


def to_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder q/k projection rows (or bias) of each head from neox to interleaved pairs."""
    rows = weight.shape[0]
    w = weight.reshape(
        rows // head_dim, 2, head_dim // 2, *weight.shape[1:]
    )  # [heads, 2, D/2, ...]
    return w.transpose(1, 2).reshape(weight.shape)
