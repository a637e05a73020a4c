"""``llmserve eval perplexity``: engine flags plus the text and window; the work is in
``perplexity.py``."""

from __future__ import annotations

import argparse
import json

from llmserve.entrypoints.engine_args import add_engine_args, engine_kwargs
from llmserve.eval.text_source import PYDOC


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="Measure model quality (perplexity)")
    evals = p.add_subparsers(dest="eval_command", required=True)
    ppl = evals.add_parser(
        "perplexity",
        help="Sliding-window perplexity of a text (default: pydoc's evaluation half)",
    )
    ppl.add_argument(
        "--dataset",
        default=PYDOC,
        help="pydoc (the second half of pydoc_data.topics) or a .txt / .jsonl file "
        '(JSON lines with a "text" field), used whole (default: pydoc)',
    )
    ppl.add_argument(
        "--max-tokens", type=int, default=None, help="score at most the first N tokens"
    )
    ppl.add_argument("--window", type=int, default=1024, help="tokens per window (default: 1024)")
    ppl.add_argument(
        "--stride", type=int, default=512, help="tokens between window starts (default: 512)"
    )
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(ppl)
    ppl.set_defaults(func=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.eval.perplexity import perplexity, windows
    from llmserve.eval.text_source import read_text
    from llmserve.quantization import loading

    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens {args.max_tokens} is not allowed; allowed: 2 or more")
    windows(args.window + 1, args.window, args.stride)  # refuse a bad window/stride first
    text = read_text(args.dataset, "evaluation")
    kwargs = engine_kwargs(args)
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = args.window + 1
    llm = LLM(**kwargs)
    token_ids = llm.get_tokenizer()(text)["input_ids"][: args.max_tokens]
    result = perplexity(llm, token_ids, args.window, args.stride)
    model = llm.llm_engine.runner.model
    weight_bytes = sum(loading.weight_bytes_by_dtype(model).values())
    report = {
        "model": args.model or "SmolLM2-135M-Instruct",
        "quantization": args.quantization,
        "dataset": args.dataset,
        "perplexity": result.perplexity,
        "num_tokens": result.num_tokens,
        "num_windows": result.num_windows,
        "window": args.window,
        "stride": args.stride,
        "weight_bytes": weight_bytes,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"perplexity {result.perplexity:.4f} over {result.num_tokens} tokens "
            f"({result.num_windows} windows of {args.window}, stride {args.stride}; "
            f"{args.dataset}); weights {weight_bytes / 2**20:.1f} MiB"
        )
    return 0
