"""``python -m llmserve.benchmarks.attention`` runs its CPU part on a small shape and writes
JSON (numbers are not checked: benchmarks are not tests)."""

from __future__ import annotations

import json

from llmserve.benchmarks import attention


def test_cpu_mode_writes_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    argv = ["--batch", "2", "--contexts", "16", "40", "--repeats", "1", "--skip-gpu"]
    attention.main([*argv, "--output-json", str(path)])
    report = json.loads(path.read_text())
    assert "gpu" not in report
    steps, paged = report["cpu"]["step"], report["cpu"]["paged_vs_contiguous"]
    assert [s["context"] for s in steps] == [p["context"] for p in paged] == [16, 40]
    for step in steps:
        parts = step["attention_ms"] + step["matmul_ms"] + step["other_ms"]
        assert step["step_ms"] > 0 and parts >= step["step_ms"] * 0.99
        assert 0 < step["attention_share"] < 1 and 0 < step["matmul_share"] < 1
        assert step["kv_read_gbs"] > 0
        # one timed step (--repeats 1): the projections add up to the step's matmul time
        names = [row["projection"] for row in step["projections"]]
        assert names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
        total = sum(row["ms"] for row in step["projections"])
        assert abs(total - step["matmul_ms"]) < 1e-6 * step["matmul_ms"] + 1e-9
        assert all(row["gflops"] > 0 and row["weight_gbs"] > 0 for row in step["projections"])
    for row in paged:
        assert row["batch"] == 2 and row["paged_ms"] > 0 and row["contiguous_sdpa_ms"] > 0
        assert row["paged_path"] == "cpp" and row["paged_cpp_ms"] == row["paged_ms"]
        assert row["max_abs_diff"] < 1e-4  # every path attends over the same K/V
    out = capsys.readouterr().out
    assert "paged (C++ kernel; torch gathered tiles) vs SDPA" in out
    assert "its matmuls by projection" in out and "float32" in out


def test_cpu_step_runs_in_bfloat16(tmp_path):
    """``--dtype bfloat16``: the model and its K/V in bf16; half the K/V bytes of fp32."""
    path = tmp_path / "attention.json"
    argv = ["--batch", "2", "--contexts", "16", "--repeats", "1", "--skip-gpu"]
    steps = {}
    for dtype in ("float32", "bfloat16"):
        attention.main([*argv, "--dtype", dtype, "--output-json", str(path)])
        report = json.loads(path.read_text())["cpu"]
        assert report["dtype"] == dtype
        steps[dtype] = report["step"][0]
    kv_bytes = {d: s["kv_read_gbs"] * s["attention_ms"] for d, s in steps.items()}
    assert abs(kv_bytes["bfloat16"] / kv_bytes["float32"] - 0.5) < 1e-6


def test_decode_attention_times_both_page_sizes_on_every_layout(capsys):
    """``python -m llmserve.benchmarks.decode_attention``: one row per (layout, pages) with the
    bytes it read per second; the huge-page pools hold the same values as the plain ones."""
    import mmap

    import torch

    from llmserve.benchmarks import decode_attention
    from llmserve.runner import kv_cache

    shape = (9, 3, 64)  # 64 x 48 tokens: pools of 200 blocks, 2.3 MiB, past one huge page
    for transposed in (False, True):
        plain = decode_attention.make_batch(64, 48, 16, torch.float32, shape, 0, transposed, False)
        huge = decode_attention.make_batch(64, 48, 16, torch.float32, shape, 0, transposed, True)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: K's stored layout and V, page-aligned
            assert huge[1].data_ptr() % kv_cache.HUGE_PAGE == 0
            assert huge[2].data_ptr() % kv_cache.HUGE_PAGE == 0
        for a, b in zip(plain, huge):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    argv = ["--batch", "2", "--contexts", "40", "--dtypes", "float32", "--block-sizes", "16"]
    rows = decode_attention.main([*argv, "--rounds", "1", "--layers", "2", "--isas", "scalar"])
    assert sorted((r["k_layout"], r["pages"]) for r in rows) == [
        ("tokens", "4k"),
        ("tokens", "huge"),
        ("transposed", "4k"),
        ("transposed", "huge"),
    ]
    assert all(r["gbs"] > 0 and r["ms_per_layer"] > 0 for r in rows)
    assert "pages" in capsys.readouterr().out


def test_decode_attention_block_orders(capsys):
    """--block-orders: each sequence's blocks in ascending or descending runs, the same blocks
    of the pool in both; shuffled tables use each block once; the kernel reads them all."""
    import torch

    from llmserve.benchmarks import decode_attention

    shape = (9, 3, 64)
    tables = {
        order: decode_attention.make_batch(4, 40, 16, torch.float32, shape, 0, True, False, order)[
            3
        ]
        for order in ("shuffled", "ascending", "descending")
    }
    assert tables["ascending"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert torch.equal(tables["descending"], tables["ascending"].flip(1))
    assert tables["shuffled"].unique().numel() == 12
    argv = ["--batch", "2", "--contexts", "40", "--dtypes", "float32", "--block-sizes", "16"]
    argv += ["--k-layouts", "transposed", "--pages", "4k", "--rounds", "1", "--layers", "2"]
    rows = decode_attention.main(
        [*argv, "--isas", "scalar", "--block-orders", "ascending", "descending"]
    )
    assert sorted(r["blocks"] for r in rows) == ["ascending", "descending"]
    header = capsys.readouterr().out.splitlines()[1]
    assert "blocks" in header.split()  # the printed table tells the orders apart


def test_prompt_attention_steps_are_causal_prompts(capsys):
    """``python -m llmserve.benchmarks.prompt_attention``: a step writes its prompts' K/V at
    their blocks and each row attends its prompt up to itself (the reference agrees), and the
    command reports one row per dtype and ISA."""
    import torch

    from llmserve.benchmarks import prompt_attention
    from llmserve.kernels import cpu as cpu_kernels
    from llmserve.kernels.reference import ref_paged_attention

    q, k, v, k_cache, v_cache, slots, tables, lens, starts = prompt_attention.make_step(
        2, 40, 16, torch.float32, 0
    )
    out = cpu_kernels.paged_attention(q, k, v, k_cache, v_cache, slots, tables, lens, starts, 0.125)
    heads, kv_heads, dim = prompt_attention.SHAPE
    assert torch.equal(k_cache.reshape(-1, kv_heads * dim)[slots], k)
    assert torch.equal(v_cache.reshape(-1, kv_heads * dim)[slots], v)
    ref = ref_paged_attention(
        q.view(-1, heads, dim), k_cache.contiguous(), v_cache, starts, lens, tables, 0.125
    )
    torch.testing.assert_close(out.view(-1, heads, dim), ref, rtol=1e-4, atol=1e-4)
    argv = ["--batch", "2", "--prompt-len", "40", "--rounds", "1", "--layers", "1"]
    rows = prompt_attention.main([*argv, "--isas", "scalar"])
    assert [(r["dtype"], r["isa"]) for r in rows] == [("float32", "scalar"), ("bfloat16", "scalar")]
    assert all(r["gflops"] > 0 and r["ms_per_layer"] > 0 for r in rows)
    assert "prompt attention, 2 prompts x 40 tokens" in capsys.readouterr().out
