"""The quantized linear layer and embedding every weight-only method shares.

``QuantLinear`` holds one ``QuantizedWeight`` (or, for a fused projection whose parts differ in
format, one per part: a GGUF file may store q/k in Q4_K and v in Q6_K) and runs the fused
dequantize-matmul kernel of its device:

    cpu        C++ kernels, chosen per call (--quantized-activations auto, the default):
               below 16 rows (decode: the weights' bytes decide) cpu_float on AVX-512 CPUs
               (int8x2 for NF4/FP4), int8x2 on AVX2; decode-then-GEMM above (prefill and big
               batches: compute decides), in bf16 tiles on CPUs with AVX512_BF16 / AMX
    cpu_float  kernels/cpu/quant_float.cpp at every size: weights decoded in registers,
               float32 activations, exact up to summation order (AVX-512 / AVX2 / portable)
    cpu_int8x2 kernels/cpu/quant_gemm.cpp: activations as two int8 digits per block of 32
               (x = s * (hi + lo / 128), 15 bits), integer dot products (AVX-512 VNNI / AVX2 /
               scalar); relative error about 1e-4
    cpu_int8   the same kernel with one digit, llama.cpp's scheme: rounding x to 8 bits costs
               accuracy on models with large activations
    cuda   Triton W4A16 / W8A16 kernel (kernels/quant_matmul.py), activations in 16 bits
    torch  dequantize, then matmul: the reference, used when neither kernel can run
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from llmserve.layers.module import Module
from llmserve.memory import HugePageArena, movable, release_freed_memory
from llmserve.quantization.layout import (
    QuantizedWeight,
    can_concat,
    concat_rows,
    reference_linear,
)

KERNELS = ("cpu", "cpu_float", "cpu_int8x2", "cpu_int8", "triton", "torch")


def default_kernel(device: torch.device, activations: str = "auto") -> str:
    """The kernel for ``device`` (``activations``: auto, float, int8x2 or int8 on the CPU)."""
    if device.type == "cuda":
        from llmserve.kernels import is_triton_available

        return "triton" if is_triton_available() else "torch"
    from llmserve.kernels.cpu import quant as cpu_quant

    if not cpu_quant.available():
        return "torch"
    return {"auto": "cpu"}.get(activations, f"cpu_{activations}")


def kernel_function(kernel: str) -> Callable[..., torch.Tensor]:
    """The ``(x, weight, bias) -> y`` function of a kernel name, resolved once per layer."""
    if kernel.startswith("cpu"):
        from llmserve.kernels.cpu.quant import linear_function

        return linear_function("auto" if kernel == "cpu" else kernel.removeprefix("cpu_"))
    if kernel == "triton":
        from llmserve.kernels.quant_matmul import quant_matmul

        return quant_matmul
    return reference_linear


class QuantLinear(Module):
    """``y = x @ W^T + b`` with ``W`` quantized; the output rows of ``parts`` are concatenated."""

    def __init__(
        self,
        parts: list[QuantizedWeight],
        bias: torch.Tensor | None = None,
        kernel: str = "torch",
        method: str = "",
    ):
        super().__init__()
        assert kernel in KERNELS, kernel
        self.parts = [concat_rows(parts)] if len(parts) > 1 and can_concat(parts) else parts
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.register_buffer("bias", bias)  # a buffer: the model's load_weights skips it
        self.kernel = kernel
        self.method = method
        self._matmul = kernel_function(kernel)  # (x [T, K], weight, bias) -> [T, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and len(self.parts) == 1:  # the engine's [T, K]: no reshapes
            return self._matmul(x, self.parts[0], self.bias)
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, K]
        if len(self.parts) == 1:
            out = self._matmul(x2, self.parts[0], self.bias)
        else:
            out = torch.cat([self._matmul(x2, p, None) for p in self.parts], dim=-1)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*leading, self.out_features)

    @property
    def weight_nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        formats = ", ".join(f"{p.bits}-bit G{p.group_size}" for p in self.parts)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"method={self.method}, {formats}, kernel={self.kernel}"
        )


def move_to_huge_pages(model: nn.Module) -> int:
    """Move every ``QuantLinear``'s blocks (codes, scales, mins) into one region of transparent
    huge pages (``memory.HugePageArena``), part by part (a tied quantized embedding follows its
    LM head's); returns the bytes moved (0: none, or no such advice). A decode step streams
    them all. Measured on an AMD Zen 4 VM (the default model, one process, moved in and out six
    times, a batch-1 step): int8 13.79 -> 13.40 ms, GGUF (Q8_0 / Q4 blocks) 10.42 -> 10.00."""
    fields = ("qweight", "scales", "mins")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    parts = {id(p): p for m in layers for p in m.parts}  # a part shared by two layers: once
    arena = HugePageArena(
        [getattr(p, f) for p in parts.values() for f in fields if movable(getattr(p, f))]
    )
    del parts
    if not arena.nbytes:
        return 0
    moved: dict[int, QuantizedWeight] = {}
    for layer in layers:
        for i, part in enumerate(layer.parts):
            if id(part) not in moved:
                copies = {
                    f: arena.copy(getattr(part, f)) for f in fields if movable(getattr(part, f))
                }
                moved[id(part)] = replace(part, **copies)
            layer.parts[i] = moved[id(part)]  # the old blocks are freed here,
            del part
            release_freed_memory()  # and handed back at once
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.weight_q = moved.get(id(module.weight_q), module.weight_q)
    release_freed_memory()
    return arena.nbytes


class QuantEmbedding(Module):
    """Token embedding whose table stays quantized; only the looked-up rows are dequantized."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        assert weight.perm is None
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.weight_q.dequantize(rows=input_ids.reshape(-1)).to(self.dtype)  # [T, hidden]
        return out.reshape(*input_ids.shape, self.embedding_dim)

    @property
    def weight_nbytes(self) -> int:
        return self.weight_q.nbytes

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{self.num_embeddings}, {self.embedding_dim}, {w.bits}-bit G{w.group_size}"
