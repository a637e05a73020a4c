"""What ``llmserve quantize`` is asked to do, checked before any work.

One frozen dataclass; the CLI flags (``--group-size``) are generated from its fields, and
``check_options`` refuses bad combinations with what was wrong and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

METHODS = ("rtn", "gptq", "awq")
BITS = {"rtn": (2, 3, 4, 8), "gptq": (2, 3, 4, 8), "awq": (4,)}
DEFAULT_NUM_SAMPLES = 128


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class QuantizeOptions:
    """Post-training weight quantization of every decoder linear layer (not the embeddings
    or the LM head) into a GPTQ (rtn, gptq) or AWQ gemm (awq) Hugging Face checkpoint."""

    model: str | None = _opt(
        None, "Hugging Face directory or GGUF file to quantize; default: SmolLM2-135M-Instruct"
    )
    output: str | None = _opt(None, "Directory to write the quantized checkpoint to (required)")
    method: str = _opt(
        "gptq",
        "rtn (round to nearest), gptq (Frantar et al. 2022), awq (Lin et al. 2023)",
        METHODS,
    )
    bits: int = _opt(4, "Bits per weight: rtn/gptq 2, 3, 4 or 8; awq 4", (2, 3, 4, 8))
    group_size: int = _opt(128, "Input columns sharing a scale and zero; -1: the whole row")
    desc_act: bool = _opt(False, "gptq: act-order, columns by descending Hessian diagonal")
    sym: bool | None = _opt(
        None, "Symmetric (zero in the middle) or asymmetric; default: sym, asym for awq"
    )
    calibration: str = _opt("pydoc", "Calibration text: pydoc (its first half) or a .txt/.jsonl")
    num_samples: int | None = _opt(
        None,
        f"Calibration sequences (default {DEFAULT_NUM_SAMPLES}; for pydoc at most as many as "
        "its calibration half holds)",
    )
    seq_len: int = _opt(512, "Tokens per calibration sequence")
    damp_percent: float = _opt(0.01, "gptq: dampening added to H's diagonal, x mean(diag(H))")
    block_size: int = _opt(128, "gptq: columns per lazy batch update")
    mse: bool = _opt(
        False,
        "rtn/gptq: shrink each group's range by a grid search minimizing |error|^2.4, as the "
        "GPTQ reference's Quantizer(mse=True) (default: the full min/max range)",
    )
    awq_search_samples: int = _opt(
        4, "awq: calibration sequences on which the alpha grid scores the block output"
    )
    overwrite: bool = _opt(False, "Replace an existing output directory")

    @property
    def is_symmetric(self) -> bool:
        return self.method != "awq" if self.sym is None else self.sym

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"


def check_options(options: QuantizeOptions) -> None:
    """Refuse, before any work, options that cannot produce a checkpoint."""
    method = options.method
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if options.bits not in BITS[method]:
        allowed = ", ".join(map(str, BITS[method]))
        extra = " (AWQ gemm checkpoints are 4-bit)" if method == "awq" else ""
        raise ValueError(
            f"--bits {options.bits} is not allowed for {method}; allowed: {allowed}{extra}"
        )
    g = options.group_size
    if g != -1 and (g <= 0 or g % 32):
        raise ValueError(
            f"--group-size {g} is not allowed; allowed: -1 (one group per row) or a positive "
            "multiple of 32 (e.g. 32, 64, 128)"
        )
    if options.desc_act and method != "gptq":
        raise ValueError(f"--desc-act is a GPTQ option; it does not apply to --method {method}")
    if method == "awq" and options.sym:
        raise ValueError(
            "--sym is not allowed with --method awq: AWQ gemm checkpoints store a zero point "
            "per group (asymmetric); omit --sym or pass --asym"
        )
    _check_counts(options)
    _check_output(options)


def _check_counts(options: QuantizeOptions) -> None:
    positive = {"--seq-len": options.seq_len, "--block-size": options.block_size}
    positive["--awq-search-samples"] = options.awq_search_samples
    if options.num_samples is not None:
        positive["--num-samples"] = options.num_samples
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag} {value} is not allowed; allowed: a positive integer")
    if not 0 <= options.damp_percent < 1:
        raise ValueError(
            f"--damp-percent {options.damp_percent} is not allowed; allowed: 0 <= value < 1 "
            "(a fraction of the mean Hessian diagonal, e.g. 0.01)"
        )


def _check_output(options: QuantizeOptions) -> None:
    if not options.output:
        raise ValueError("--output DIR is required (the directory to write the checkpoint to)")
    if os.path.exists(options.output) and not options.overwrite:
        raise ValueError(
            f"output {options.output!r} already exists; pass --overwrite to replace it, or "
            "choose a new directory"
        )
    if os.path.isfile(options.output):
        raise ValueError(f"output {options.output!r} is a file; give a directory path")
