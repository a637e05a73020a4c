"""CUDA-graph decode: the bucketing and padding that run on the host, checked on CPU.

The padded batch a graph replays is run here eagerly through the Triton backend (in the
interpreter): padding rows must leave the KV pool untouched and the real rows unchanged.
The capture itself needs a GPU (last test, skipped without one).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

from llmserve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from llmserve.runner.cuda_graph import CUDAGraphRunner, bucket_for, capture_sizes  # noqa: E402

BLOCK_SIZE = 8
MAX_MODEL_LEN = 64


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (10, [1, 2, 4, 8, 16]),
        (40, [1, 2, 4, 8, 16, 24, 32, 40]),
        (256, [1, 2, 4, 8, *range(16, 257, 8)]),
        (10_000, [1, 2, 4, 8, *range(16, 513, 8)]),  # capped at MAX_CAPTURED_BATCH
    ],
)
def test_capture_sizes(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_bucket_for():
    sizes = capture_sizes(32)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    assert bucket_for(33, sizes) is None


def _decode_meta(
    seq_lens: list[int], tables: list[list[int]], device: torch.device = DEVICE
) -> AttentionMetadata:
    """A decode step: each sequence's one new token sits at position seq_len - 1."""
    width = max(len(t) for t in tables)
    slots = [
        t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
        for n, t in zip(seq_lens, tables)
    ]
    return AttentionMetadata(
        num_decodes=len(seq_lens),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )


SEQ_LENS = [9, 3, 20]
TABLES = [[4, 7], [2], [0, 5, 1]]


def test_fill_pads_to_the_bucket():
    cpu = torch.device("cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), [], 16, MAX_MODEL_LEN, BLOCK_SIZE, cpu)
    assert runner.block_tables.shape == (16, MAX_MODEL_LEN // BLOCK_SIZE)
    runner.seq_lens.fill_(99)  # stale values from an earlier, larger step
    meta = _decode_meta(SEQ_LENS, TABLES, cpu)
    assert not runner.can_use(meta)  # nothing captured on CPU
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([8, 2, 19])
    assert runner.fill(ids, positions, meta) == 4
    assert runner.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert runner.positions[:4].tolist() == [8, 2, 19, 0]
    assert runner.slot_mapping[:4].tolist() == [7 * 8 + 0, 2 * 8 + 2, 1 * 8 + 3, -1]
    assert runner.seq_lens[:4].tolist() == [9, 3, 20, 0]
    assert runner.block_tables[:3, :3].tolist() == [[4, 7, 0], [2, 0, 0], [0, 5, 1]]
    static = runner.static_meta(4)
    assert static.num_decodes == static.num_seqs == 4
    assert static.block_tables.shape == (4, MAX_MODEL_LEN // BLOCK_SIZE)


def _tiny_model(backend: str, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig

    from llmserve.models.llama import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config, MAX_MODEL_LEN, backend)
    for param in model.parameters():
        torch.nn.init.normal_(param.data, std=0.2)
    return model.eval()


def _pool(num_layers: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (8, BLOCK_SIZE, 2, 16)
    return [
        (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
        for _ in range(num_layers)
    ]


def _decode_inputs():
    ids = torch.tensor([11, 12, 13], device=DEVICE)
    positions = torch.tensor([n - 1 for n in SEQ_LENS], device=DEVICE)
    return ids, positions, _decode_meta(SEQ_LENS, TABLES)


@torch.inference_mode()
def test_padded_batch_matches_eager():
    pytest.importorskip("triton")
    model = _tiny_model("triton", DEVICE)
    ids, positions, meta = _decode_inputs()
    eager_pool, padded_pool, untouched = _pool(2, DEVICE), _pool(2, DEVICE), _pool(2, DEVICE)
    expected = model(ids, positions, eager_pool, meta)  # [3, hidden]

    runner = CUDAGraphRunner(model, padded_pool, 8, MAX_MODEL_LEN, BLOCK_SIZE, DEVICE)
    bucket = runner.fill(ids, positions, meta)
    args = (runner.input_ids[:bucket], runner.positions[:bucket], padded_pool)
    got = model(*args, runner.static_meta(bucket))  # what a replay computes: [4, hidden]

    torch.testing.assert_close(got[:3], expected, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(got[3:]).all()  # a seq_len-0 row attends to nothing: zeros, not NaN
    written = meta.slot_mapping.tolist()
    for (k_eager, v_eager), (k_pad, v_pad), (k_old, _) in zip(eager_pool, padded_pool, untouched):
        torch.testing.assert_close(k_pad, k_eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_pad, v_eager, atol=1e-5, rtol=1e-5)
        keep = torch.ones(k_old.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
        keep[written] = False  # every other slot is exactly as before (padding wrote nothing)
        assert torch.equal(k_pad.flatten(0, 1)[keep], k_old.flatten(0, 1)[keep])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.inference_mode()
def test_graph_replay_matches_eager_on_gpu():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process interprets Triton kernels; run this test file alone on a GPU")
    model = _tiny_model("triton", DEVICE)
    ids, positions, meta = _decode_inputs()
    eager_pool, graph_pool = _pool(2, DEVICE), _pool(2, DEVICE)
    expected = model(ids, positions, eager_pool, meta)
    runner = CUDAGraphRunner(model, graph_pool, 8, MAX_MODEL_LEN, BLOCK_SIZE, DEVICE)
    runner.capture()
    assert runner.can_use(meta)
    for _ in range(2):  # replays are repeatable
        got = runner.forward(ids, positions, meta)
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    for (k_eager, _), (k_graph, _) in zip(eager_pool, graph_pool):
        torch.testing.assert_close(k_graph, k_eager, atol=1e-3, rtol=1e-3)
