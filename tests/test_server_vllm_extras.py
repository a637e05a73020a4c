"""vLLM's extra request fields on the real server (``llmserve serve`` in a subprocess, started
with ``--return-tokens-as-token-ids --stream-interval 2``): continue_final_message, the
prefix cache's cached_tokens and cache_salt, allowed_token_ids, bad_words,
truncate_prompt_tokens, return_token_ids and return_tokens_as_token_ids, stream_interval; and
cache_salt offline."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_process import SMALL_SERVER_ARGS, ServerProcess
from tests.test_server import MAX_TOKENS, MESSAGES, PROMPT, chat, complete


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(
        *SMALL_SERVER_ARGS, "--return-tokens-as-token-ids", "--stream-interval", "2"
    )
    yield server
    server.close()


def tokenize(server, prompt: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=10).json()[
        "tokens"
    ]


def test_chat_continues_the_final_message(server, client, model, offline_llm):
    """continue_final_message leaves the last (assistant) message open: its tokens end the
    prompt, no end-of-turn after them, and the reply carries it on, as offline."""
    from llmserve import SamplingParams

    begun = [*MESSAGES, {"role": "assistant", "content": "2 + 2 ="}]

    def tokens(**flags):
        body = {"messages": begun, "add_generation_prompt": False, **flags}
        return httpx.post(server.url + "/tokenize", json=body, timeout=10).json()["tokens"]

    closed, open_ = tokens(), tokens(continue_final_message=True)
    assert len(open_) < len(closed) and closed[: len(open_)] == open_  # the end-of-turn cut
    text = httpx.post(server.url + "/detokenize", json={"tokens": open_}, timeout=10).json()
    assert text["prompt"].endswith("2 + 2 =")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    response = chat(client, model, messages=begun, extra_body=flags)
    assert response.usage.prompt_tokens == len(open_)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    offline = offline_llm.chat(begun, params, use_tqdm=False, **flags)[0]
    assert offline.prompt_token_ids == open_
    assert response.choices[0].message.content == offline.outputs[0].text
    both = {"messages": begun, "continue_final_message": True}  # add_generation_prompt: true
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = httpx.post(server.url + path, json=both, timeout=10)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "continue_final_message"
    with pytest.raises(ValueError, match="cannot both be true"):
        offline_llm.chat(begun, params, continue_final_message=True)


def test_usage_counts_prompt_tokens_from_the_prefix_cache(client, model):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI's: none the first time a prompt is
    seen, its whole blocks (16 tokens each here) the second time."""
    prompt = " ".join(f"w{i}q{i * 7}" for i in range(20))  # seen by no other test
    first = complete(client, model, prompt=prompt).usage
    second = complete(client, model, prompt=prompt).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.prompt_tokens
    assert second.prompt_tokens == first.prompt_tokens


def test_allowed_token_ids_and_truncate_prompt_tokens(server, client, model):
    """vLLM's extra fields: tokens from the allowed set only; a bad word never generated; the
    prompt cut to its last k."""

    def token_id(text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        (token,) = httpx.post(server.url + "/tokenize", json=body, timeout=10).json()["tokens"]
        return token

    allowed = [token_id(" yes"), token_id(" no")]
    body = {"allowed_token_ids": allowed, "ignore_eos": True}
    response = complete(client, model, temperature=1.0, seed=3, extra_body=body)
    assert re.fullmatch("( yes| no)+", response.choices[0].text)
    assert response.usage.completion_tokens == MAX_TOKENS
    free = complete(client, model).choices[0].text
    word = free.split()[0]
    banned = complete(client, model, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in banned.split()
    cut = complete(client, model, extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    reply = chat(client, model, extra_body={"truncate_prompt_tokens": 3})
    assert reply.usage.prompt_tokens == 3


def test_cache_salt_shares_cached_blocks_within_one_salt(server, client, model):
    """A salted prompt's blocks serve only requests of the same salt: another salt, or none,
    computes the prompt afresh."""
    prompt = " ".join(f"s{i}x{i * 3}" for i in range(20))  # seen by no other test

    def cached(salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        return complete(
            client, model, prompt=prompt, extra_body=body
        ).usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0  # unsalted requests do not see the salted blocks either
    assert cached(None) > 0
    reply = chat(client, model, extra_body={"cache_salt": "tenant-c"})
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    for bad in ("", "a/b", "a@b", "x" * 129, 7):
        body = {"model": model, "prompt": prompt, "cache_salt": bad}
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 400
        assert "cache_salt" in refused.text


def test_cache_salt_and_reset_prefix_cache_offline(offline_llm):
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2)
    prompt = " ".join(f"o{i}y{i * 5}" for i in range(20))

    def cached(salt: str) -> int:
        (out,) = offline_llm.generate([{"prompt": prompt, "cache_salt": salt}], params)
        return out.num_cached_tokens

    assert [cached("a"), cached("b")] == [0, 0]
    assert cached("a") > 0 and cached("b") > 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        offline_llm.generate([{"prompt": prompt, "cache_salt": ""}], params)
    assert offline_llm.reset_prefix_cache()  # as vLLM's: every cached block forgotten
    assert cached("a") == 0


def test_return_token_ids(server, client, model):
    """The choices' token ids (their text as decoded) and the prompt's; streamed, the prompt's
    in the first chunk and each chunk's new tokens."""
    body = {"return_token_ids": True}
    response = complete(client, model, extra_body=body)
    (choice,) = response.choices
    assert choice.prompt_token_ids == tokenize(server, PROMPT)
    assert len(choice.token_ids) == response.usage.completion_tokens
    text = httpx.post(server.url + "/detokenize", json={"tokens": choice.token_ids}, timeout=10)
    assert text.json()["prompt"] == choice.text
    chunks = list(complete(client, model, stream=True, extra_body=body))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    assert complete(client, model).choices[0].token_ids is None  # only when asked

    reply = chat(client, model, extra_body=body)
    assert reply.prompt_token_ids and len(reply.prompt_token_ids) == reply.usage.prompt_tokens
    assert len(reply.choices[0].token_ids) == reply.usage.completion_tokens
    chunks = list(chat(client, model, stream=True, extra_body=body))
    assert chunks[0].prompt_token_ids == reply.prompt_token_ids
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    streamed = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert streamed == reply.choices[0].token_ids


def test_tokens_as_token_ids(client, model):
    """This server names logprob tokens ``token_id:N`` unless a request says otherwise."""
    body = {"return_token_ids": True}
    response = complete(client, model, logprobs=2, extra_body=body)
    (choice,) = response.choices
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    for top in choice.logprobs.top_logprobs:
        assert all(re.fullmatch(r"token_id:\d+", key) for key in top)
    texts = complete(client, model, logprobs=2, extra_body={"return_tokens_as_token_ids": False})
    assert "".join(texts.choices[0].logprobs.tokens) == texts.choices[0].text

    reply = chat(client, model, logprobs=True, top_logprobs=2, extra_body=body)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in reply.choices[0].token_ids]
    assert content[0].bytes == list(content[0].token.encode())
    assert all(re.fullmatch(r"token_id:\d+", t.token) for c in content for t in c.top_logprobs)


def test_chat_echo_puts_the_last_message_first(client, model):
    """vLLM's chat echo: the reply begins with the last message when that message has the
    reply's role (an assistant message continued), streamed or not; after a user message,
    nothing is echoed."""
    begun = [*MESSAGES, {"role": "assistant", "content": "2 + 2 ="}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(client, model, messages=begun, extra_body=flags).choices[0].message.content
    flags["echo"] = True
    echoed = chat(client, model, messages=begun, extra_body=flags).choices[0].message.content
    assert echoed == "2 + 2 =" + plain
    chunks = list(chat(client, model, messages=begun, stream=True, extra_body=flags))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed
    new_turn = chat(client, model, extra_body={"echo": True}).choices[0].message.content
    assert new_turn == chat(client, model).choices[0].message.content


def test_continuous_usage_stats(client, model):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (
        complete(client, model, stream=True, stream_options=options),
        chat(client, model, stream=True, stream_options=options),
    ):
        chunks = list(stream)
        final = chunks[-1].usage  # include_usage's chunk, with no choices
        assert not chunks[-1].choices and final.completion_tokens > 0
        assert all(c.usage.prompt_tokens == final.prompt_tokens for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == final.completion_tokens
    assert list(chat(client, model, stream=True))[0].usage is None  # only when asked


def test_completions_take_response_format_and_tokenize_gives_token_strs(server, client, model):
    """response_format in /v1/completions (as vLLM's, not only chat); /tokenize's
    return_token_strs (the byte-level tokens, a space written as "Ġ")."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    choice = complete(client, model, max_tokens=48, extra_body={"response_format": fmt}).choices[0]
    assert choice.finish_reason == "stop"
    assert json.loads(choice.text)["answer"] in ("yes", "no")
    body = {"prompt": PROMPT, "return_token_strs": True}
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=10).json()
    assert len(tokens["token_strs"]) == tokens["count"]
    assert "".join(tokens["token_strs"]).replace("Ġ", " ") == PROMPT
    assert (
        httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()[
            "token_strs"
        ]
        is None
    )


def test_stream_interval(server, client, model):
    """Streamed chunks gather the server's 2 new tokens (--stream-interval 2), or a request's
    stream_interval where larger (one below it changes nothing); the first chunk comes at
    once, the last when the text ends, and together they hold the non-streamed text. A chunk
    may hold more than the interval (a handler that falls behind skips to the newest output),
    never fewer but the first and the last."""
    body = {"return_token_ids": True}
    whole = complete(client, model, extra_body=body).choices[0]
    for interval, least in ((None, 2), (1, 2), (3, 3)):
        chunks = list(
            complete(client, model, stream=True, extra_body={**body, "stream_interval": interval})
        )
        counts = [len(c.choices[0].token_ids) for c in chunks]
        assert counts[0] == 1 and all(n >= least for n in counts[1:-1]), (interval, counts)
        assert len(chunks) <= 1 + -(-(MAX_TOKENS - 1) // least)
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids
    replies = list(chat(client, model, stream=True, extra_body={"stream_interval": 4}))
    assert "".join(c.choices[0].delta.content or "" for c in replies) == (
        chat(client, model).choices[0].message.content
    )
    refused = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "stream": True, "stream_interval": 0},
        timeout=10,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_interval"
