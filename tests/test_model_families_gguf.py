"""Every family that llama.cpp's GGUF has, loaded from GGUF: the tiny random model of
test_model_families.py, written as llama.cpp's converter writes it (tests/gguf_writer.py),
must give back the checkpoint's tensors and, through ``LLM``, the same prompt log-probs and
greedy tokens as the Hugging Face directory; and where transformers reads that GGUF
architecture itself, the same tensors as transformers' own GGUF loading.
"""

from __future__ import annotations

import os

# as in test_model_families.py: set before llmserve imports triton, whichever file runs first
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.loader.gguf_loader import iter_gguf_tensors, load_gguf_config  # noqa: E402
from llmserve.loader.hf_loader import iter_hf_tensors  # noqa: E402
from tests.conftest import assert_no_leaks  # noqa: E402
from tests.gguf_writer import write_gguf  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    FAMILIES,
    GEMMA,
    GPT,
    LLAMA_LIKE,
    MOE,
    PROMPTS,
    WINDOW,
    _perturb,
)

NUM_TOKENS = 6
TOP = 5

# Where a family's test config holds something GGUF cannot (noted), the closest that it can.
GGUF_FAMILIES = {
    "gemma": FAMILIES["gemma"],
    # GGUF keeps no query_pre_attn_scalar: head_dim is assumed (as for all Gemma 2 but the 27B)
    "gemma2": lambda: T.Gemma2Config(
        **GEMMA,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "phi3": lambda: T.Phi3Config(
        **LLAMA_LIKE, pad_token_id=0, sliding_window=WINDOW, partial_rotary_factor=0.5
    ),
    # transformers' GGUF reader takes n_ctx, not n_positions, from the file: GPT-2's 1024
    "gpt2": lambda: T.GPT2Config(**{**GPT, "n_positions": 1024}),
    "starcoder": FAMILIES["gpt-bigcode"],
    "gptj": FAMILIES["gptj"],  # llama.cpp's starcoder is multi-query only
    "falcon-7b-style": FAMILIES["falcon-7b-style"],
    "falcon-40b-style": FAMILIES["falcon-40b-style"],
    "gptneox": FAMILIES["gpt-neox"],
    "gptneox-sequential": FAMILIES["gpt-neox-sequential"],
    "bloom": FAMILIES["bloom"],
    "phi2": FAMILIES["phi"],
    "qwen3moe": FAMILIES["qwen3-moe"],
    "mpt": FAMILIES["mpt"],
    "mixtral": lambda: T.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, **MOE),
}
# transformers' GGUF loader reads these architectures (and undoes their layouts) itself. Its
# configs are rougher (phi3: no partial rotary or window; gemma2: query_pre_attn_scalar left
# at 256), so the weights are compared, not logits.
TRANSFORMERS_READS = {"gemma2", "phi3", "gpt2", "bloom", "falcon-7b-style"}
TRANSFORMERS_GAPS = {
    "qwen3moe": "transformers ignores qwen3moe.expert_feed_forward_length",
    "falcon-40b-style": "transformers reads no Falcon 40B layout (two norms, kv groups)",
    "mixtral": "transformers reads a llama GGUF with experts as a dense Llama",
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(GGUF_FAMILIES[name](), dtype=torch.float32)
    _perturb(model)
    return model.eval()


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def saved(request, tmp_path_factory):
    """(name, HF directory, GGUF path) of one family's tiny model."""
    name, folder = request.param, tmp_path_factory.mktemp(request.param)
    _model(name).save_pretrained(folder / "hf")
    gguf_path = str(folder / f"tiny-{name}.gguf")
    write_gguf(gguf_path, str(folder / "hf"))
    return name, str(folder / "hf"), gguf_path


def test_tensors_match_checkpoint(saved):
    """The GGUF reader undoes every converter change: the checkpoint's own tensors."""
    name, hf_dir, gguf_path = saved
    expected = {n: t for n, t in iter_hf_tensors(hf_dir) if not n.endswith(".attn.bias")}
    ours = dict(iter_gguf_tensors(gguf_path))
    config = load_gguf_config(gguf_path)
    if config.tie_word_embeddings or "lm_head.weight" not in expected:
        ours.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    assert ours.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(ours[key], weight.float(), rtol=1e-6, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _run(path: str, tokenizer, monkeypatch) -> tuple[list, list]:
    # Token ids in, token ids out: one tokenizer for both (transformers builds a tokenizer
    # from GGUF metadata only for some architectures, and each its own way).
    monkeypatch.setattr("llmserve.tokenizer.get_tokenizer", lambda *args, **kwargs: tokenizer)
    llm = LLM(path, kv_cache_memory=2 << 20, max_model_len=64, block_size=4)
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, prompt_logprobs=TOP
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_no_leaks(llm)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [{i: float(getattr(lp, "logprob", lp)) for i, lp in row.items()} for row in rows]
        for rows in (o.prompt_logprobs[1:] for o in outputs)
    ]
    return tokens, logprobs


def test_logits_match_hf_directory(saved, tokenizer, monkeypatch):
    """Through the whole engine: the GGUF file and the HF directory give the same numbers."""
    _, hf_dir, gguf_path = saved
    hf_tokens, hf_logprobs = _run(hf_dir, tokenizer, monkeypatch)
    gguf_tokens, gguf_logprobs = _run(gguf_path, tokenizer, monkeypatch)
    assert gguf_tokens == hf_tokens
    for ours, theirs in zip(gguf_logprobs, hf_logprobs):
        for row_ours, row_theirs in zip(ours, theirs, strict=True):
            assert row_ours.keys() == row_theirs.keys()
            for token in row_ours:
                assert row_ours[token] == pytest.approx(row_theirs[token], abs=1e-4)


def test_matches_transformers_gguf_loading(saved):
    """transformers' own GGUF reading of the same file: the checkpoint's weights."""
    name, hf_dir, gguf_path = saved
    if name not in TRANSFORMERS_READS:
        default = f"transformers does not read the {name} GGUF architecture"
        pytest.skip(TRANSFORMERS_GAPS.get(name, default))
    folder, file = os.path.split(gguf_path)
    theirs = T.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    expected = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    weights = theirs.state_dict()
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, msg=key)


# ---- text in, text out: files with a real vocabulary (tokenizer from the GGUF metadata) ----
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, 12 cats"]


def tiny_gguf(folder, name: str, vocabulary: dict, tokenizer=None) -> tuple[str, str]:
    """(GGUF path, HF directory) of ``GGUF_FAMILIES[name]``'s tiny random model with
    ``vocabulary``; ``tokenizer`` is saved in the HF directory."""
    config = GGUF_FAMILIES[name]()
    config.vocab_size = len(vocabulary["tokens"])
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    hf_dir, path = str(folder / f"{name}-hf"), str(folder / f"{name}.gguf")
    model.save_pretrained(hf_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf_dir)
    write_gguf(path, hf_dir, vocabulary=vocabulary)
    return path, hf_dir


@pytest.mark.parametrize("name", ["gemma", "gptj", "gptneox", "starcoder", "phi2", "mpt"])
def test_text_prompts_through_the_file_tokenizer(name, tmp_path, request):
    """The GGUF file alone opens in ``LLM``: text prompts give the tokens and text of the HF
    directory holding the tokenizer transformers builds from the vocabulary's own file."""
    if name == "gemma":
        vocabulary = request.getfixturevalue("gemma_vocabulary")
        reference = request.getfixturevalue("gemma_reference")[1]
    else:
        vocabulary = request.getfixturevalue("smollm_cut_vocabulary")
        reference = request.getfixturevalue("smollm_cut_reference")
    path, hf_dir = tiny_gguf(tmp_path, name, vocabulary, reference)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    results = []
    for model in (path, hf_dir):
        llm = LLM(model, kv_cache_memory=4 << 20, max_model_len=64, block_size=4)
        outputs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
        assert_no_leaks(llm)
        results.append(
            [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
        )
    ours, theirs = results
    assert [r[0] for r in ours] == [reference.encode(p) for p in TEXT_PROMPTS]
    assert ours == theirs
    assert all(text for _, _, text in ours)
