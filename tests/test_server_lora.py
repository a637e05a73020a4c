"""``llmserve serve --enable-lora --lora-modules``: a request's ``model`` picks the adapter.

A real server on a tiny Llama with PEFT adapters (tests/test_lora.py builds them): /v1/models
lists the adapters with their base; completions under an adapter's name give PEFT's greedy
tokens, and completions, chat and responses carry that name; an unknown name is 404;
adapters loaded and unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING, vLLM's switch),
bad ones refused with 400 (at load, or at their first request when only the weights show
it); the engine in a process of its own (the adapter travels with the request) gives the
same tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_process import ServerProcess
from tests.test_lora import NUM_TOKENS, PROMPTS, make_llama_with_adapters

pytest.importorskip("peft")

TIMEOUT = httpx.Timeout(60.0)
ARGS = ["--max-model-len", "128", "--kv-cache-memory", "8000000", "--block-size", "8"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from llmserve.tokenizer import get_tokenizer

    return make_llama_with_adapters(tmp_path_factory.mktemp("lora-server"), get_tokenizer(None))


def _serve(llama, *extra: str, env: dict | None = None) -> ServerProcess:
    base, adapters, _ = llama
    described = json.dumps({"name": "qv", "path": adapters["qv-rs"][0], "base_model_name": "tiny"})
    modules = ["--lora-modules", f"all={adapters['all'][0]}", described]
    return ServerProcess(
        base, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
        *modules, *ARGS, *extra, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(llama):
    proc = _serve(llama, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield proc
    proc.stop()


def complete(server, model: str, prompt: str = PROMPTS[1]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    return httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)


def tokens(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_models_lists_the_adapters_with_their_base(server, llama):
    _, adapters, _ = llama
    cards = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "all", "qv"]
    assert cards[1]["root"] == adapters["all"][0] and cards[1]["parent"] == "tiny"
    one = httpx.get(server.url + "/v1/models/qv", timeout=TIMEOUT).json()
    assert one["root"] == adapters["qv-rs"][0]


def test_the_model_field_picks_the_adapter(server, llama):
    _, adapters, base_tokens = llama
    assert tokens(complete(server, "all")) == adapters["all"][1][1]
    assert tokens(complete(server, "qv")) == adapters["qv-rs"][1][1]
    assert tokens(complete(server, "tiny")) == base_tokens[1]
    reply = complete(server, "all")
    assert reply.json()["model"] == "all"
    body = {"model": "qv", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and all(c["model"] == "qv" for c in chunks)
    body = {"model": "all", "input": "hi", "max_output_tokens": 3}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json()["model"] == "all"
    missing = complete(server, "nope")
    assert missing.status_code == 404
    assert "'all'" in missing.json()["error"]["message"]


def test_adapters_load_and_unload_at_run_time(server, llama, tmp_path):
    _, adapters, _ = llama

    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=TIMEOUT)

    loaded = post("load_lora_adapter", lora_name="mlp", lora_path=adapters["mlp"][0])
    assert loaded.status_code == 200 and "mlp" in loaded.text
    assert tokens(complete(server, "mlp")) == adapters["mlp"][1][1]
    again = post("load_lora_adapter", lora_name="mlp", lora_path=adapters["mlp"][0])
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    bad = post("load_lora_adapter", lora_name="x", lora_path=str(tmp_path / "none"))
    assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
    assert post("unload_lora_adapter", lora_name="mlp").status_code == 200
    assert complete(server, "mlp").status_code == 404
    assert post("unload_lora_adapter", lora_name="mlp").status_code == 404


def test_an_adapter_the_engine_cannot_run_is_a_400(server, tmp_path):
    """Its config reads well, so it is served; its weights fit another base model, so its
    requests are refused with that reason, and the server goes on."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.tokenizer import get_tokenizer
    from tests.test_lora import _llama_config

    other = AutoModelForCausalLM.from_config(_llama_config(get_tokenizer(None), hidden=32))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(other, config).save_pretrained(str(tmp_path / "other"))
    body = {"lora_name": "other", "lora_path": str(tmp_path / "other")}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 200
    refused = complete(server, "other")
    assert refused.status_code == 400
    assert "another base model" in refused.json()["error"]["message"]
    assert complete(server, "all").status_code == 200


def test_the_engine_core_process_runs_the_adapters(llama):
    """The adapter goes to the engine's process with the request; no runtime routes here."""
    _, adapters, _ = llama
    proc = _serve(llama, "--engine-core-process")
    try:
        assert tokens(complete(proc, "qv")) == adapters["qv-rs"][1][1]
        assert tokens(complete(proc, "all")) == adapters["all"][1][1]
        body = {"lora_name": "mlp", "lora_path": adapters["mlp"][0]}
        route = httpx.post(proc.url + "/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
        assert route.status_code == 404
    finally:
        proc.stop()


def test_lora_modules_without_enable_lora_fail_the_start(llama):
    base, adapters, _ = llama
    with pytest.raises(RuntimeError, match="--enable-lora"):
        ServerProcess(base, "--lora-modules", f"a={adapters['all'][0]}", *ARGS)
