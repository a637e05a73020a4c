"""GPU half of ``python -m llmserve.benchmarks.attention`` (see its docstring): FlashAttention
vs materialized attention vs torch SDPA, paged decode bandwidth, CUDA graphs vs eager."""

from __future__ import annotations

import argparse
import functools
import gc
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from llmserve.benchmarks.attention import time_ms
from llmserve.benchmarks.decode_step import decode_batch
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


def _prefill_inputs(n: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """One sequence of ``n`` random bf16 tokens, as the paged kernel's arguments (q, K/V pool of
    16-token blocks, start_loc, seq_lens, block table) and as SDPA's ``[1, H, N, D]`` q, k, v."""
    device, dtype, block_size = torch.device("cuda"), torch.bfloat16, 16
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
    return (q, k_cache, v_cache, start_loc, seq_lens, tables), (q4, k4, v4)


def flash_vs_materialized(n: int, repeats: int, num_heads=32, num_kv_heads=8, head_dim=64) -> dict:
    """One causal prefill of ``n`` tokens (bf16): Triton flash over the paged pool, the
    materialized N x N attention, and torch SDPA; time and peak extra memory of each."""
    from llmserve import kernels

    device, scale = torch.device("cuda"), head_dim**-0.5
    paged, (q4, k4, v4) = _prefill_inputs(n, num_heads, num_kv_heads, head_dim)
    paths = {
        "flash_triton": lambda: kernels.flash_attn_varlen_paged(*paged, scale, n),
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


def _kernel_ms(fn: Callable[[], Any]) -> float:
    """Median kernel time under CUDA events, L2 flushed between runs (triton.testing)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=40, return_mode="median")


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
    # Kernel time from CUDA events: a decode step replays it inside a CUDA graph, so the host's
    # launch (tens of microseconds, a tenth of the kernel at 64 x 4096) is not part of it.
    ms = _kernel_ms(
        lambda: kernels.paged_decode_attention(
            q, k_cache, v_cache, meta.seq_lens, meta.block_tables, head_dim**-0.5
        )
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


# ---- GPU: launch shapes of the two Triton kernels --------------------------------------------
# (block_m, block_n, num_warps, num_stages); the first of each list is the shipped default
# for bf16 at head dim 64 (the others were slower on an H100: docs/benchmarks.md).
FLASH_TILES = [(128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3),
               (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 16, 3)]  # fmt: skip
DECODE_TILES = [(1, bn, warps, stages) for bn in (64, 32, 128) for warps in (4, 2, 8)
                for stages in (3, 2)]  # fmt: skip


def _sweep_prefill(n: int, num_heads: int, num_kv_heads: int, head_dim: int) -> list[dict]:
    from llmserve import kernels
    from llmserve.kernels.flash_attention import TileConfig

    paged, sdpa_args = _prefill_inputs(n, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    sdpa_ms = _kernel_ms(lambda: F.scaled_dot_product_attention(*sdpa_args, is_causal=True))
    reference = F.scaled_dot_product_attention(*sdpa_args, is_causal=True)[0].transpose(0, 1)
    flops = 2 * n * n * head_dim * num_heads  # causal: half of 4 * N^2 * D per head
    rows = []
    for shape in FLASH_TILES:
        row: dict[str, Any] = {"n": n, "tile": "x".join(map(str, shape)), "sdpa_ms": sdpa_ms}
        fn = functools.partial(kernels.flash_attn_varlen_paged, *paged, scale, n,
                               tile=TileConfig(*shape))  # fmt: skip
        try:
            row["max_abs_diff"] = (fn().float() - reference.float()).abs().max().item()
            row["ms"] = _kernel_ms(fn)
            row["tflops"] = flops / row["ms"] / 1e9
            row["vs_sdpa"] = row["ms"] / sdpa_ms
        except Exception as exc:  # a tile that does not fit (shared memory, registers)
            row["error"] = type(exc).__name__
        rows.append(row)
    return rows


def _sweep_decode(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int):
    from llmserve import kernels
    from llmserve.kernels.flash_attention import TileConfig

    device, dtype = torch.device("cuda"), torch.bfloat16
    caches, meta = decode_batch(batch, context, 16, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize
    rows = []
    for shape in DECODE_TILES:
        for splits in (None, 4):
            row = {"batch": batch, "context": context, "tile": "x".join(map(str, shape[1:])),
                   "splits": splits or "auto"}  # fmt: skip
            fn = functools.partial(
                kernels.paged_decode_attention, q, *caches, meta.seq_lens, meta.block_tables,
                head_dim**-0.5, num_splits=splits, tile=TileConfig(*shape),
            )  # fmt: skip
            try:
                row["ms"] = _kernel_ms(fn)
                row["gbs"] = kv_bytes / row["ms"] / 1e6
            except Exception as exc:  # a tile that does not fit
                row["error"] = type(exc).__name__
            rows.append(row)
    return rows


def tile_sweep(prefill_lens: list[int], decode_shapes: list[tuple[int, int]],
               num_heads=32, num_kv_heads=8, head_dim=64) -> dict:  # fmt: skip
    """Every tile of FLASH_TILES on one causal prefill of each length (against SDPA's flash
    path, timed the same way) and every tile of DECODE_TILES on each decode shape (bf16)."""
    shape = (num_heads, num_kv_heads, head_dim)
    return {
        "prefill": [r for n in prefill_lens for r in _sweep_prefill(n, *shape)],
        "decode": [r for b, c in decode_shapes for r in _sweep_decode(b, c, *shape)],
    }


def print_tile_sweep(sweep: dict) -> None:
    tables = [
        ("causal prefill (bf16; block_m x block_n x warps x stages)", "prefill",
         ("n", "tile", "ms", "tflops", "sdpa_ms", "vs_sdpa", "max_abs_diff", "error")),
        ("paged decode (bf16; block_n x warps x stages)", "decode",
         ("batch", "context", "tile", "splits", "ms", "gbs", "error")),
    ]  # fmt: skip
    for title, key, cols in tables:
        if sweep[key]:
            print(f"\ntile sweep, {title}")
            print(format_table(cols, [[r.get(c, "") for c in cols] for r in sweep[key]]))


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
    if args.sweep_tiles:
        return {
            "device": torch.cuda.get_device_name(),
            "tile_sweep": tile_sweep(args.prefill_lens, args.decode_shapes),
        }
    return {
        "device": torch.cuda.get_device_name(),
        "flash": [flash_vs_materialized(n, args.repeats) for n in args.prefill_lens],
        "copy_gbs": copy_gbs(device, args.repeats),
        "decode": [decode_bandwidth(b, c, peak) for b, c in args.decode_shapes],
        "graphs": graphs_vs_eager(
            args.graph_batch_sizes, args.graph_prompt_len, args.graph_output_len, args.model
        ),
    }


def print_gpu(gpu: dict) -> None:
    if "tile_sweep" in gpu:
        print(f"\nGPU {gpu['device']}")
        print_tile_sweep(gpu["tile_sweep"])
        return
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
