"""``llmserve quantize``: flags generated from ``QuantizeOptions``; the work is ``quantize()``."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from llmserve.quantization.quantizers.config import QuantizeOptions


def _scalar_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="Quantize a float model with RTN, GPTQ or AWQ into a GPTQ/AWQ checkpoint",
        description=QuantizeOptions.__doc__,
    )
    hints = get_type_hints(QuantizeOptions)
    for f in dataclasses.fields(QuantizeOptions):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + (f" (default: {f.default})" * (f.default is not None))
        kind = _scalar_type(hints[f.name])
        if f.name == "sym":
            sym = p.add_mutually_exclusive_group()
            sym.add_argument("--sym", dest="sym", action="store_true", default=None, help=help_text)
            sym.add_argument("--asym", dest="sym", action="store_false", help="Asymmetric")
        elif kind is bool:
            p.add_argument(flag, action="store_true", default=f.default, help=help_text)
        else:
            p.add_argument(
                flag, type=kind, default=f.default, choices=f.metadata["choices"], help=help_text
            )
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from llmserve.quantization.quantizers.pipeline import quantize

    names = {f.name for f in dataclasses.fields(QuantizeOptions)}
    report = quantize(**{k: v for k, v in vars(args).items() if k in names})
    samples = f", {report.num_samples} x {report.seq_len} calibration tokens" * bool(
        report.num_samples
    )
    print(
        f"wrote {report.output}: {report.method} {report.bits}-bit, group size "
        f"{report.group_size}, {report.num_layers} linear layers{samples}; "
        f"{report.seconds:.1f} s, peak memory {report.peak_memory_bytes / 2**20:.0f} MiB"
    )
    return 0
