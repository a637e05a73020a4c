"""``llmserve`` command line: ``generate``, ``serve``, ``bench``, ``quantize``, ``eval``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from llmserve.entrypoints.engine_args import add_engine_args, engine_kwargs

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def read_prompts(path: str) -> list[str]:
    """One prompt per line; JSONL lines may be strings or objects with a "prompt" field."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                item = json.loads(line)
                line = item if isinstance(item, str) else item["prompt"]
            prompts.append(line)
    return prompts


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="Generate text for prompts (offline batch)")
    p.add_argument("model_path", nargs="?", default=None, help="model (same as --model)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="file with one prompt per line, or JSONL")
    p.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from llmserve import LLM, SamplingParams

    prompts = list(args.prompt) + (read_prompts(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        print("error: give --prompt TEXT or --prompts-file FILE", file=sys.stderr)
        return 2
    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_path or kwargs.get("model")
    llm = LLM(**kwargs)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        for c in out.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "index": c.index,
                            "text": c.text,
                            "finish_reason": c.finish_reason,
                        }
                    )
                )
            else:
                print(
                    f"--- prompt: {prompt!r} [output {c.index}, finish: {c.finish_reason}]\n{c.text}"
                )
    return 0


# the module whose ``add_parser`` registers each subcommand (``generate`` is this file's)
SUBCOMMAND_MODULES = {
    "serve": "llmserve.entrypoints.openai.api_server",
    "bench": "llmserve.benchmarks.cli",
    "quantize": "llmserve.quantization.quantizers.cli",
    "eval": "llmserve.eval.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser; with ``command`` (a known subcommand) only that one's, so
    ``llmserve generate ...`` does not import the server's, the benchmarks' and the
    quantizers' modules (torch, transformers, FastAPI) to parse its flags: a bad flag is
    reported in well under a second instead of ~7 s on a slow host."""
    parser = argparse.ArgumentParser(
        prog="llmserve", description="LLM inference and serving engine"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    only = command if command in ("generate", *SUBCOMMAND_MODULES) else None
    if only in (None, "generate"):
        add_generate_parser(subparsers)
    for name, module_name in SUBCOMMAND_MODULES.items():
        if only not in (None, name):
            continue
        try:
            module = __import__(module_name, fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
