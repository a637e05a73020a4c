"""GPTQ (Frantar et al. 2022): quantize one linear layer column by column, each rounding error
spread over the columns not yet quantized through the inverse Hessian of the layer inputs.

For inputs ``X [K, tokens]`` the layer-wise objective ``||W X - Q X||^2`` has Hessian
``H = 2 X X^T / tokens`` (``HessianAccumulator``). With ``U`` the upper Cholesky factor of
``H^-1`` (after dampening), quantizing column ``j`` to ``q`` moves the later columns by

    W[:, j:] -= ((W[:, j] - q) / U[j, j]) * U[j, j:]

done exactly inside a block of 128 columns and once per block for the rest (lazy batch
updates). A group's (scale, zero) are fixed when its first column comes up, from the current
(already error-corrected) weights (past the current block: without the block's pending update,
as in the reference code). Act-order (``desc_act``) visits columns by descending
``diag(H)`` and groups them in that order, so ``g_idx`` is no longer ``k // G``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llmserve.quantization.quantizers.rtn import QuantResult, group_params, quantize_values

MAX_DAMP_TRIES = 6


class HessianAccumulator:
    """``H = 2 / n * sum_t x_t x_t^T`` over the ``n`` calibration tokens seen."""

    def __init__(self, in_features: int):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.num_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """``x [..., K]``: a batch of layer inputs."""
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, K]
        self.sum += (x.T @ x).double()
        self.num_tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        assert self.num_tokens > 0, "no calibration tokens reached this layer"
        return (2.0 * self.sum / self.num_tokens).float()


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool = False,
    damp_percent: float = 0.01,
    block_size: int = 128,
    mse: bool = False,
) -> QuantResult:
    """GPTQ of ``weight [N, K]`` given ``hessian [K, K]``; rows are independent, so layers
    sharing an input (q/k/v, gate/up) may be passed stacked along N."""
    w = weight.detach().float().clone()  # [N, K]
    h = hessian.float().clone()  # [K, K]
    k = w.shape[1]
    dead = torch.diag(h) == 0  # inputs that are always zero: any weight works
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    g = k if group_size == -1 else group_size
    with single_thread():  # many small ops: 20x faster than waking threads on a busy CPU
        u = inverse_hessian_factor(h, damp_percent)  # [K, K] upper
        codes, scales, zeros = _quantize_columns(w, u, bits, g, sym, block_size, mse)
    g_idx = torch.arange(k) // g
    if perm is not None:
        inverse = torch.argsort(perm)
        codes, g_idx = codes[:, inverse], g_idx[inverse]
    return QuantResult(codes.to(torch.uint8), zeros.long(), scales, g_idx, bits)


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread inside the block."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def inverse_hessian_factor(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * I)^-1``, ``damp = damp_percent * mean(diag H)``;
    the dampening is raised tenfold (from 0.1% if zero) until H is positive definite."""
    h64 = h.double()
    mean_diag = torch.diag(h64).mean()
    damp = damp_percent
    for _ in range(MAX_DAMP_TRIES):
        damped = h64 + damp * mean_diag * torch.eye(h.shape[0], dtype=torch.float64)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inverse, upper=True).float()
        damp = damp * 10 if damp > 0 else 1e-3
    raise ValueError(
        f"the layer's Hessian is not positive definite even with dampening {damp:g}; "
        "use more or longer calibration samples, or a larger --damp-percent"
    )


def _quantize_columns(w, u, bits, group_size, sym, block_size, mse=False):
    """The column loop: codes ``[N, K]``, scales and zeros ``[N, K / G]`` (column order of w)."""
    n, k = w.shape
    codes = torch.zeros(n, k)
    scales = torch.zeros(n, k // group_size)
    zeros = torch.zeros(n, k // group_size)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()  # [N, B] current block, updated column by column
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                group = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group_size]  # [N, G]
                scale, zero = group_params(group, bits, sym, mse=mse)
                scales[:, col // group_size], zeros[:, col // group_size] = scale, zero
            q = quantize_values(w1[:, i], scale, zero, bits)  # [N]
            codes[:, col] = q
            err = (w1[:, i] - scale * (q - zero)) / u1[i, i]  # [N]
            w1[:, i:] -= err[:, None] * u1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return codes, scales, zeros
