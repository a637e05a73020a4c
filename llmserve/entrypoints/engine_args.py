"""CLI flags generated from the config dataclasses: ``max_model_len`` -> ``--max-model-len``."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from llmserve.config import CONFIG_CLASSES


def _scalar_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config field (booleans get ``--x`` / ``--no-x``)."""
    for klass in CONFIG_CLASSES:
        group = parser.add_argument_group(klass.__name__, klass.__doc__)
        hints = get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _scalar_type(hints[f.name])
            help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
            if kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                group.add_argument(
                    flag,
                    type=kind,
                    default=f.default,
                    choices=f.metadata.get("choices"),
                    help=help_text,
                )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags that belong to the engine, as ``LLM(**kwargs)`` keywords."""
    names = {f.name for klass in CONFIG_CLASSES for f in dataclasses.fields(klass)}
    return {k: v for k, v in vars(args).items() if k in names}
