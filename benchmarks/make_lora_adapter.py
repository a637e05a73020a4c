"""A PEFT LoRA adapter on every attention and MLP projection of a Llama-family model, with
random A and B (PEFT's ``gaussian`` init leaves B at zero, which times the same but changes
nothing; ``--nonzero`` draws B too): for timing LoRA (``llmserve bench throughput
--lora-path``), not for its outputs.

    python -m llmserve.benchmarks.export_hf --output /tmp/smollm2-hf      # the default model
    python benchmarks/make_lora_adapter.py /tmp/smollm2-hf /tmp/smollm2-lora-r16 --rank 16

Needs ``peft`` (in the test extras).
"""

from __future__ import annotations

import argparse

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="Hugging Face directory of the base model")
    p.add_argument("out", help="directory to write the adapter to")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--nonzero", action="store_true", help="random B too (outputs change)")
    args = p.parse_args()
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        target_modules=TARGETS,
        init_lora_weights=False if args.nonzero else "gaussian",
    )
    peft.get_peft_model(base, config).save_pretrained(args.out)
    print(f"rank-{args.rank} adapter on {', '.join(TARGETS)} written to {args.out}")


if __name__ == "__main__":
    main()
