"""The attention backends agree: torch paged attention (decodes through gathered tiles or
the C++ kernel) against the plain reference, and the engine's greedy outputs with
``attention_backend="torch"``, ``"cpp"`` and ``"triton"`` (run by Triton's interpreter on
CPU) on a tiny random GQA Llama, where transformers is the witness (and, with
LLMSERVE_SLOW_TESTS=1, triton against torch on the default model).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.kernels import cpu as cpu_kernels  # noqa: E402
from llmserve.kernels.reference import ref_paged_attention  # noqa: E402
from llmserve.layers import paged_attention_torch as pat  # noqa: E402
from llmserve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from tests.conftest import assert_no_leaks  # noqa: E402
from tests.kernels.kernel_testing import make_paged_batch  # noqa: E402

triton = pytest.importorskip("triton")


# ---- torch paged attention against the reference ------------------------------------------
def _meta(batch, num_decodes: int) -> AttentionMetadata:
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    return AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),  # K/V already in the pool
        max_query_len=max(q_lens),
        max_seq_len=int(batch.seq_lens.max()),
        query_lens_cpu=q_lens,
        seq_lens_cpu=batch.seq_lens.tolist(),
    )


BATCHES = {  # (query lengths, context lengths): decodes first, then prefill chunks
    "decodes": ([1, 1, 1, 1], [5, 17, 33, 64]),
    "equal-decodes": ([1] * 5, [32] * 5),
    "mixed": ([1, 1, 4, 7], [16, 9, 9, 30]),
    "prefix-chunks": ([5, 3, 12], [5, 40, 12]),
    "one-prefill": ([9], [9]),  # no cached prefix: SDPA's causal mask
    "decodes-and-one-prefill": ([1, 1, 6], [10, 20, 6]),
}


DECODE_PATHS = {  # how decodes attend: gathered tiles of a given byte budget, or the C++ kernel
    "one-tile": (pat.TILE_BYTES_PER_THREAD, False),
    "many-tiles": (1000, False),
    "cpp": (pat.TILE_BYTES_PER_THREAD, True),
}


@pytest.mark.parametrize("decode_path", list(DECODE_PATHS))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_torch_paged_attention_matches_reference(name, heads, decode_path, monkeypatch):
    tile_bytes, native = DECODE_PATHS[decode_path]
    if native:
        assert cpu_kernels.available(), "the C++ CPU kernels failed to build (see the log)"
    monkeypatch.setattr(pat, "TILE_BYTES_PER_THREAD", tile_bytes)
    q_lens, seq_lens = BATCHES[name]
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size=8)
    # Unowned slots hold NaN in the kernel tests; here they hold large finite junk, which
    # the mask must keep out (a NaN would poison a masked softmax in SDPA).
    batch.k_cache.nan_to_num_(nan=1e3)
    batch.v_cache.nan_to_num_(nan=-1e3)
    meta = _meta(batch, num_decodes=sum(1 for n in q_lens if n == 1))
    plan = pat.build_plan(meta, block_size=8, native_decode=native)
    # this step's new K/V: the last q_len positions of each sequence (already in the pool)
    k_new = torch.cat([k[len(k) - n :] for k, n in zip(batch.keys, q_lens)])
    v_new = torch.cat([v[len(v) - n :] for v, n in zip(batch.values, q_lens)])
    args = (batch.q, batch.k_cache, batch.v_cache)
    for _ in range(2):  # a second layer reuses the plan's tiles and buffers
        out = pat.paged_attention_torch(batch.q, k_new, v_new, *args[1:], meta, plan, scale=0.3)
        expected = ref_paged_attention(
            *args, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.3
        )
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_decode_tiles_cover_the_batch_within_budget():
    tiles = pat.plan_decode_tiles([5, 17, 33, 8, 8, 100], block_size=8, tile_tokens=48)
    assert [(t.start, t.end) for t in tiles] == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert [t.num_blocks for t in tiles] == [3, 5, 1, 13]  # longest context in the tile
    assert [t.seq_len for t in tiles] == [None, 33, 8, 100]  # None: lengths differ, mask
    tiles = pat.plan_decode_tiles([5, 17, 33, 8, 8, 100], block_size=8, tile_tokens=48, min_seqs=2)
    assert [(t.start, t.end) for t in tiles] == [(0, 2), (2, 4), (4, 6)]  # over budget: 2 each
    assert pat.plan_decode_tiles([], 8, 48) == []
    one = pat.plan_decode_tiles([7] * 64, block_size=8, tile_tokens=1 << 20)
    assert [(t.start, t.end, t.seq_len) for t in one] == [(0, 64, 7)]


# ---- engine: torch vs triton (interpreted) ------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)


def _generate(model: str | None, backend: str, prompts: list[str], **options) -> list[list[int]]:
    llm = LLM(model, attention_backend=backend, max_model_len=256, **options)
    assert llm.llm_engine.runner.attention_backend == backend
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.skipif(
    os.environ.get("LLMSERVE_SLOW_TESTS") != "1",
    reason="30 interpreted layers take 1-2 minutes; set LLMSERVE_SLOW_TESTS=1 (the tiny Llama "
    "tests below cover the same paths)",
)
def test_default_model_triton_matches_torch():
    prompts = ["Hello", "The capital of France is"]
    options = dict(kv_cache_memory=12 << 20)  # a small pool: the interpreter copies it per launch
    torch_ids = _generate(None, "torch", prompts, **options)
    assert _generate(None, "triton", prompts, **options) == torch_ids


TINY_PROMPTS = ["Hello there", "SELECT name FROM users WHERE age >", "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer GQA Llama (head_dim 64, as the default model) with random weights, saved
    with the default model's tokenizer; returns its path and transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmserve.tokenizer import get_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = get_tokenizer(None)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    expected = []
    for prompt in TINY_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=GREEDY.max_tokens,
            min_new_tokens=GREEDY.max_tokens,
            pad_token_id=0,
        )
        expected.append(out[0, ids.shape[1] :].tolist())
    return str(path), expected


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_tiny_llama_matches_transformers(tiny_llama, backend):
    # A 5-token budget splits the prompts into chunks that share steps with decodes.
    path, expected = tiny_llama
    options = dict(kv_cache_memory=2 << 20, block_size=8, max_num_batched_tokens=5)
    assert _generate(path, backend, TINY_PROMPTS, **options) == expected
