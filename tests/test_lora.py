"""LoRA adapters (llmserve/lora/) on tiny random models against PEFT on the same weights.

Greedy tokens equal PEFT's for each adapter alone and mixed in one batch with other adapters
and the base model; Llama (fused q/k/v and gate/up, rsLoRA, alpha_pattern) and GPT-2 (Conv1D,
fan_in_fan_out, fused c_attn). The scheduler's max_loras, the prefix cache kept per adapter,
the loaded adapters bounded by max_cpu_loras, bad adapters refused with what is wrong, an
int8 base under an adapter, ``llmserve bench throughput --lora-path``.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from llmserve import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_no_leaks
from tests.fake_engine import FakeEngine, make_request
from tests.test_architectures import NUM_TOKENS, PROMPTS
from tests.test_architectures import _reference as _greedy  # transformers' greedy tokens

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama_config(tokenizer, hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip


def _gpt2_config(tokenizer):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip


def _save_adapter(base, path, seed: int, **lora_config):
    """A PEFT adapter with random A and B on a copy of ``base``, saved at ``path``; the PEFT
    model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora_config)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(str(path))
    return model


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def make_llama_with_adapters(root, tokenizer):
    """A tiny Llama (GQA) and three PEFT adapters of it under ``root``: (base directory,
    {adapter name: (path, PEFT's greedy tokens on PROMPTS)}, the base's greedy tokens)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_llama_config(tokenizer), dtype=torch.float32).eval()
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    specs = {
        "all": dict(r=8, lora_alpha=16, target_modules=LLAMA_LINEARS),
        "qv-rs": dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj"],
            alpha_pattern={"v_proj": 2},
        ),  # fmt: skip
        "mlp": dict(
            r=2,
            lora_alpha=4,
            target_modules=["gate_proj", "down_proj"],
            rank_pattern={"down_proj": 4},
        ),  # fmt: skip
    }
    adapters = {}
    for seed, (name, spec) in enumerate(specs.items(), start=1):
        model = _save_adapter(base, root / name, seed, **spec)
        adapters[name] = (str(root / name), _greedy(model, tokenizer))
    with torch.no_grad():
        base_tokens = _greedy(base, tokenizer)
    for name, (_, tokens) in adapters.items():
        assert tokens != base_tokens, f"adapter {name} changes nothing: the test could not fail"
    return str(root / "base"), adapters, base_tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer):
    return make_llama_with_adapters(tmp_path_factory.mktemp("lora-llama"), tokenizer)


def _lora(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, adapters[name][0])


@pytest.fixture(scope="module")
def llm(llama):
    base, _, _ = llama
    return LLM(
        base, kv_cache_memory=8 << 20, max_model_len=128, block_size=8,
        enable_lora=True, max_loras=3,
    )  # fmt: skip


def test_each_adapter_matches_peft(llm, llama):
    _, adapters, base_tokens = llama
    for i, name in enumerate(adapters, start=1):
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=_lora(adapters, name, i))
        assert _tokens(got) == adapters[name][1], name
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == base_tokens
    assert_no_leaks(llm)


def test_adapters_and_base_mixed_in_one_batch(llm, llama):
    """Each prompt with its own adapter (or none) in the same steps: prompts' last rows
    (pruned outputs), then decode rows of three adapters and the base model."""
    _, adapters, base_tokens = llama
    names = [*adapters, None]
    prompts, loras, expected = [], [], []
    for j, prompt in enumerate(PROMPTS):
        for k in range(len(names)):
            name = names[(j + k) % len(names)]
            prompts.append(prompt)
            loras.append(None if name is None else _lora(adapters, name, names.index(name) + 1))
            expected.append(base_tokens[j] if name is None else adapters[name][1][j])
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert _tokens(got) == expected
    assert_no_leaks(llm)


def test_prefix_cache_kept_apart_per_adapter(llm, llama):
    _, adapters, _ = llama
    prompt = " ".join(f"w{i}" for i in range(24))  # several blocks of 8, seen by no other test
    params = SamplingParams(temperature=0, max_tokens=2)
    a, b = _lora(adapters, "all", 1), _lora(adapters, "qv-rs", 2)

    def cached(lora) -> int:
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[
            0
        ].num_cached_tokens

    assert cached(a) == 0
    assert cached(a) > 0
    assert cached(b) == 0
    assert cached(None) == 0
    assert cached(None) > 0


def test_scheduler_keeps_to_max_loras():
    """With max_loras 2, a step never holds a third adapter: its request waits, those after
    it (the base model's, an adapter's already in the step) go ahead."""
    engine = FakeEngine(num_blocks=256, block_size=4)
    engine.scheduler.max_loras = 2
    ids = [1, 2, 3, 0, 1]
    for i, lora_id in enumerate(ids):
        request = make_request(f"r{i}", prompt_len=5, max_tokens=3)
        if lora_id:
            request.lora_request = LoRARequest(f"a{lora_id}", lora_id, "/unused")
        engine.add(request)
    first = engine.step()
    assert sorted(s.seq.request.request_id for s in first.scheduled) == ["r0", "r1", "r3", "r4"]
    engine.run()
    for out in engine.outputs:
        loras = {s.seq.request.lora_request for s in out.scheduled} - {None}
        assert len(loras) <= 2
    assert any("r2" in {s.seq.request.request_id for s in o.scheduled} for o in engine.outputs)
    engine.bm.check_idle()


def test_max_loras_one_still_serves_every_adapter(llama):
    base, adapters, base_tokens = llama
    llm = LLM(base, kv_cache_memory=8 << 20, max_model_len=128, block_size=8, enable_lora=True)
    names = list(adapters)
    loras = [_lora(adapters, n, i) for i, n in enumerate(names, start=1)] + [None]
    got = llm.generate([PROMPTS[0]] * 4, GREEDY, use_tqdm=False, lora_request=loras)
    expected = [adapters[n][1][0] for n in names] + [base_tokens[0]]
    assert _tokens(got) == expected
    # max_cpu_loras defaults to max_loras, 1: adapters that requests named stayed loaded
    # beyond it; the next load drops those no request names any more
    assert llm.llm_engine.list_loras() == {1, 2, 3}
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[0])
    assert _tokens(again) == [adapters[names[0]][1][0]]
    assert llm.llm_engine.list_loras() == {1}
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[1])
    assert _tokens(again) == [adapters[names[1]][1][0]]  # loaded again from its directory
    assert llm.llm_engine.list_loras() == {2}
    assert llm.llm_engine.remove_lora(2) is True
    assert llm.llm_engine.list_loras() == set()
    assert llm.llm_engine.remove_lora(2) is False
    assert_no_leaks(llm)


def test_bad_adapters_are_refused_and_the_engine_goes_on(llm, llama, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    base, adapters, base_tokens = llama
    path = adapters["all"][0]
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=_lora(adapters, "all", 1))

    def refused(lora: LoRARequest, *words: str) -> None:
        with pytest.raises(ValueError) as e:
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
        for word in words:
            assert word in str(e.value), str(e.value)

    refused(LoRARequest("gone", 20, str(tmp_path / "missing")), "not a directory")
    for key, value, words in [
        ("use_dora", True, ("DoRA",)),
        ("r", 32, ("rank 32", "--max-lora-rank")),
        ("bias", "all", ("bias",)),
    ]:
        bad = tmp_path / f"bad-{key}"
        shutil.copytree(path, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        refused(LoRARequest(key, 21, str(bad)), *words)
    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_pretrained(base)
    _save_adapter(base_model, tmp_path / "head", 9, r=4, target_modules=["lm_head"])
    refused(LoRARequest("head", 22, str(tmp_path / "head")), "lm_head", "LM head")
    other = AutoModelForCausalLM.from_config(_llama_config(tokenizer, hidden=32))
    _save_adapter(other, tmp_path / "other", 9, r=4, target_modules=["q_proj"])
    refused(LoRARequest("other", 23, str(tmp_path / "other")), "another base model")
    refused(LoRARequest("all-again", 1, adapters["qv-rs"][0]), "lora_int_id 1 is loaded")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, path)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == base_tokens
    assert_no_leaks(llm)


def test_lora_off_or_beside_parallelism_is_refused(llama):
    base, adapters, _ = llama
    plain = LLM(base, kv_cache_memory=4 << 20, max_model_len=128, block_size=8)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=_lora(adapters, "all", 1))
    with pytest.raises(ValueError, match="LoRA adapters run on one engine"):
        LLM(base, enable_lora=True, tensor_parallel_size=2)


def test_gpt2_conv1d_adapter_matches_peft(tmp_path, tokenizer):
    """GPT-2's Conv1D layers ([in, out], fan_in_fan_out) and its fused c_attn (q, k, v)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_gpt2_config(tokenizer), dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    targets = ["c_attn", "c_proj", "c_fc"]
    model = _save_adapter(
        base, tmp_path / "lora", 5, r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=True
    )
    expected = _greedy(model, tokenizer)
    with torch.no_grad():
        assert expected != _greedy(base, tokenizer)
    llm = LLM(
        str(tmp_path / "base"), kv_cache_memory=4 << 20, max_model_len=128, block_size=8,
        enable_lora=True,
    )  # fmt: skip
    lora = LoRARequest("gpt2-lora", 1, str(tmp_path / "lora"))
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == expected


def test_bench_throughput_runs_every_request_with_the_adapter(llama, tmp_path, capsys):
    """``llmserve bench throughput --lora-path``: LoRA switched on, requests over --max-loras
    adapter ids (two adapters in one step here); a peer backend is refused."""
    from llmserve.entrypoints.cli import main

    base, adapters, _ = llama
    out = tmp_path / "lora.json"
    argv = ["bench", "throughput", "--model", base, "--lora-path", adapters["all"][0],
            "--max-loras", "2", "--num-prompts", "4", "--output-len", "4", "--disable-tqdm",
            "--kv-cache-memory", "8000000", "--max-model-len", "256"]  # fmt: skip
    assert main([*argv, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["lora_path"] == adapters["all"][0]
    assert report["engine_args"]["enable_lora"] is True
    assert report["total_output_tokens"] == 16 and report["output_throughput"] > 0
    assert main([*argv, "--backend", "transformers"]) == 2
    assert "--lora-path runs on the llmserve backend only" in capsys.readouterr().err


def test_a_quantized_base_keeps_its_layers_under_the_adapter(llama):
    """On an int8 base the adapter wraps the quantized layer: rows of the adapter get the
    quantized product plus (x A^T)(s B^T), the others the quantized product alone."""
    from llmserve.lora.layers import LoRALinear
    from llmserve.quantization.linear import QuantLinear

    base, adapters, _ = llama
    llm = LLM(
        base, quantization="int8", kv_cache_memory=8 << 20, max_model_len=128, block_size=8,
        enable_lora=True,
    )  # fmt: skip
    plain = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    lora = _lora(adapters, "all", 1)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) != plain
    layer = llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, QuantLinear)
    x = torch.randn(3, layer.in_features)
    layer.batch.set([1, 0, 1], None)
    low_rank = layer.adapters[1]
    want = layer.base(x)
    want[[0, 2]] += x[[0, 2]] @ low_rank.a_t @ low_rank.b_t
    torch.testing.assert_close(layer(x), want)
    layer.batch.set([0, 0, 0], None)
    torch.testing.assert_close(layer(x), layer.base(x))


def test_chat_and_beam_search_take_the_adapter(llm, llama):
    """``chat`` runs its templated prompt with the adapter as ``generate`` does;
    ``beam_search``'s beams are not the base model's."""
    from llmserve import BeamSearchParams

    _, adapters, _ = llama
    lora = _lora(adapters, "all", 1)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    ids = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora)
    same = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False, lora_request=lora)
    base = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert _tokens(chat) == _tokens(same) != _tokens(base)
    params = BeamSearchParams(2, 6, ignore_eos=True)
    beams = llm.beam_search(PROMPTS[:1], params, lora_request=lora)[0].sequences
    plain = llm.beam_search(PROMPTS[:1], params)[0].sequences
    assert [b.tokens for b in beams] != [b.tokens for b in plain]
    assert_no_leaks(llm)
