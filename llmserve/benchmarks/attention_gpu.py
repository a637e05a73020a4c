"""GPU half of ``python -m llmserve.benchmarks.attention`` (see its docstring): FlashAttention
vs materialized attention vs torch SDPA, paged decode bandwidth, CUDA graphs vs eager."""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from llmserve.benchmarks.attention import decode_batch, time_ms
from llmserve.benchmarks.report import format_table

# HBM peak bandwidth (GB/s) by device name fragment; --hbm-peak-gbs overrides.
HBM_PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
                "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864,
                "L4": 300, "A10G": 600, "RTX 4090": 1008}  # fmt: skip
LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=5632,
    max_position_embeddings=4096,
)


# ---- GPU: FlashAttention vs materialized vs SDPA --------------------------------------------
def _peak_mib(fn: Callable[[], Any], device: torch.device) -> float:
    """Memory ``fn`` allocates at its peak beyond what was allocated before, in MiB."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _materialized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention with the full score matrix: q/k/v ``[1, H, N, D]``."""
    n = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale  # [1, H, N, N]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)  # [N, N]
    scores.masked_fill_(causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def flash_vs_materialized(n: int, repeats: int, num_heads=32, num_kv_heads=8, head_dim=64) -> dict:
    """One causal prefill of ``n`` tokens (bf16): Triton flash over the paged pool, the
    materialized N x N attention, and torch SDPA; time and peak extra memory of each."""
    from llmserve import kernels

    device, dtype, block_size, scale = torch.device("cuda"), torch.bfloat16, 16, head_dim**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn_like(k)
    num_blocks = -(-n // block_size)
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(pool_shape, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, num_kv_heads, head_dim)[:n] = k
    v_cache.view(-1, num_kv_heads, head_dim)[:n] = v
    tables = torch.arange(num_blocks, device=device, dtype=torch.int32)[None]  # [1, blocks]
    start_loc = torch.tensor([0, n], device=device, dtype=torch.int32)
    seq_lens = torch.tensor([n], device=device, dtype=torch.int32)
    group = num_heads // num_kv_heads
    q4 = q.transpose(0, 1)[None]  # [1, H, N, D]
    k4 = k.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()  # [1, H, N, D]
    v4 = v.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()
    paths = {
        "flash_triton": lambda: kernels.flash_attn_varlen_paged(
            q, k_cache, v_cache, start_loc, seq_lens, tables, scale, n
        ),
        "materialized": lambda: _materialized(q4, k4, v4, scale),
        "torch_sdpa": lambda: F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale
        ),
    }
    result: dict[str, Any] = {
        "n": n,
        "heads": num_heads,
        "kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    reference = paths["torch_sdpa"]()[0].transpose(0, 1)  # [N, H, D]
    for name, fn in paths.items():
        try:
            out = fn()
            out = out if name == "flash_triton" else out[0].transpose(0, 1)
            result[f"{name}_max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
            del out
            result[f"{name}_ms"] = time_ms(fn, repeats, device)
            result[f"{name}_peak_mib"] = _peak_mib(fn, device)
        except torch.cuda.OutOfMemoryError:
            result[f"{name}_ms"] = result[f"{name}_peak_mib"] = "OOM"
        gc.collect()
        torch.cuda.empty_cache()
    return result


# ---- GPU: paged decode bandwidth ------------------------------------------------------------
def hbm_peak_gbs(override: float | None) -> float | None:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((gbs for frag, gbs in HBM_PEAK_GBS.items() if frag in name), None)


def copy_gbs(device: torch.device, repeats: int) -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second (achievable peak)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() / ms / 1e6


def decode_bandwidth(
    batch: int,
    context: int,
    repeats: int,
    peak: float | None,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
) -> dict:
    """Triton paged decode attention (bf16): K/V bytes of the whole batch over its time."""
    from llmserve import kernels

    device = torch.device("cuda")
    (k_cache, v_cache), meta = decode_batch(
        batch, context, 16, num_kv_heads, head_dim, torch.bfloat16, device
    )
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    ms = time_ms(
        lambda: kernels.paged_decode_attention(
            q, k_cache, v_cache, meta.seq_lens, meta.block_tables, head_dim**-0.5
        ),
        repeats,
        device,
    )
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    gbs = kv_bytes / ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "ms": ms,
        "kv_mib": kv_bytes / 2**20,
        "gbs": gbs,
        "hbm_peak_gbs": peak,
        "fraction_of_peak": gbs / peak if peak else None,
    }


# ---- GPU: decode throughput with and without CUDA graphs ------------------------------------
def write_llama_1b(path: str, tokenizer_model: str | None) -> str:
    """Config (~1B parameters) and ``tokenizer_model``'s tokenizer (None: the default model's);
    the weights come from ``--load-format dummy``."""
    from transformers import LlamaConfig

    from llmserve.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(tokenizer_model)
    LlamaConfig(
        **LLAMA_1B,
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def decode_throughput(
    model_path: str, enforce_eager: bool, batch_sizes: list[int], prompt_len: int, output_len: int
) -> tuple[list[dict], list[list[int]]]:
    """Output tokens per second for each batch size (greedy, EOS ignored), and the tokens."""
    from llmserve import LLM, SamplingParams

    llm = LLM(
        model_path,
        load_format="dummy",
        enforce_eager=enforce_eager,
        max_model_len=prompt_len + output_len + 16,
        max_num_seqs=max(batch_sizes),
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.hf_config.vocab_size
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm-up
    rows, tokens = [], []
    for batch in batch_sizes:
        prompts = [
            {"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()}
            for _ in range(batch)
        ]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rows.append(
            {"batch": batch, "seconds": elapsed, "output_tok_s": batch * output_len / elapsed}
        )
        tokens += [o.outputs[0].token_ids for o in outputs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows, tokens


def graphs_vs_eager(
    batch_sizes: list[int], prompt_len: int, output_len: int, tokenizer_model: str | None
) -> dict:
    with tempfile.TemporaryDirectory() as path:
        write_llama_1b(path, tokenizer_model)
        eager, eager_tokens = decode_throughput(path, True, batch_sizes, prompt_len, output_len)
        graphs, graph_tokens = decode_throughput(path, False, batch_sizes, prompt_len, output_len)
    rows = [
        {"batch": e["batch"], "eager_tok_s": e["output_tok_s"], "graphs_tok_s": g["output_tok_s"],
         "speedup": g["output_tok_s"] / e["output_tok_s"]}
        for e, g in zip(eager, graphs)
    ]  # fmt: skip
    same = sum(a == b for a, b in zip(eager_tokens, graph_tokens))
    return {
        "model": "random-weight Llama " + ", ".join(f"{k}={v}" for k, v in LLAMA_1B.items()),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "rows": rows,
        "identical_sequences": f"{same}/{len(eager_tokens)}",
    }


def run_gpu(args: argparse.Namespace) -> dict:
    peak = hbm_peak_gbs(args.hbm_peak_gbs)
    device = torch.device("cuda")
    return {
        "device": torch.cuda.get_device_name(),
        "flash": [flash_vs_materialized(n, args.repeats) for n in args.prefill_lens],
        "copy_gbs": copy_gbs(device, args.repeats),
        "decode": [decode_bandwidth(b, c, args.repeats, peak) for b, c in args.decode_shapes],
        "graphs": graphs_vs_eager(
            args.graph_batch_sizes, args.graph_prompt_len, args.graph_output_len, args.model
        ),
    }


def print_gpu(gpu: dict) -> None:
    print(f"\nGPU {gpu['device']}: causal prefill, one sequence of N tokens (bf16)")
    cols = [
        f"{p}_{m}"
        for p in ("flash_triton", "materialized", "torch_sdpa")
        for m in ("ms", "peak_mib")
    ]
    print(format_table(["n", *cols], [[r["n"], *(r[c] for c in cols)] for r in gpu["flash"]]))
    print(f"\npaged decode bandwidth (device copy: {gpu['copy_gbs']:.0f} GB/s)")
    cols = ("batch", "context", "ms", "kv_mib", "gbs", "hbm_peak_gbs", "fraction_of_peak")
    print(format_table(cols, [[r[c] for c in cols] for r in gpu["decode"]]))
    graphs = gpu["graphs"]
    print(f"\ndecode throughput, {graphs['model']}; identical: {graphs['identical_sequences']}")
    cols = ("batch", "eager_tok_s", "graphs_tok_s", "speedup")
    print(format_table(cols, [[r[c] for c in cols] for r in graphs["rows"]]))
