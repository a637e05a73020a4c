"""The offline API as a vLLM user drives it, on the default model."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from llmserve import LLM, RequestOutputKind, SamplingParams
from llmserve.engine.llm_engine import bad_words_token_ids
from tests.conftest import assert_no_leaks

SQL = "Write SQL that counts rows of t."


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=96 << 20, max_model_len=512)


def test_parallel_sampling_n2_with_seed(llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, n=2, seed=0)
    outs = llm.generate([SQL, "Hello"], params, use_tqdm=False)
    assert [o.prompt for o in outs] == [SQL, "Hello"]
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1]
        assert all(c.finish_reason in ("stop", "length") and c.token_ids for c in out.outputs)
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids
    again = llm.generate([SQL], params, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == [c.text for c in outs[0].outputs]
    assert_no_leaks(llm)


def test_seed_gives_same_output_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = llm.generate([SQL], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0.7, max_tokens=8, seed=9),
    ]
    batch = llm.generate(["Tell me a joke", "1 2 3", SQL], others + [seeded], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert_no_leaks(llm)


def _greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 24), **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_stop_string_across_token_boundary(llm):
    tokenizer = llm.get_tokenizer()
    ref = _greedy(llm, SQL, min_tokens=24)
    pieces = [tokenizer.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    # a stop string made of the end of token 5 and the start of token 6
    cut = len(pieces[4])
    assert len(pieces[5]) - cut >= 2
    stop = pieces[5][cut - 2 : cut + 2] if cut >= 2 else pieces[5][: cut + 2]
    out = _greedy(llm, SQL, stop=[stop], min_tokens=0)
    index = ref.text.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:index]
    kept = _greedy(llm, SQL, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == ref.text[: index + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    ref = _greedy(llm, SQL, min_tokens=10, max_tokens=10)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    stop_id = ref.token_ids[3]
    out = _greedy(llm, SQL, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop_id) + 1]


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate([SQL], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for token_id, entry in zip(comp.token_ids, comp.logprobs):
        assert token_id in entry and len(entry) >= 3
        assert entry[token_id] == pytest.approx(max(entry.values()))  # greedy picks the top one
        assert all(v <= 0.0 for v in entry.values())
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(comp.token_ids, comp.logprobs))
    )
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in entry and len(entry) >= 2


def test_prompt_logprobs_survive_chunked_prefill():
    small = LLM(kv_cache_memory=32 << 20, max_model_len=256, max_num_batched_tokens=4)
    big = LLM(kv_cache_memory=32 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = small.generate([SQL], params, use_tqdm=False)[0].prompt_logprobs
    b = big.generate([SQL], params, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)


def test_token_id_prompts_order_and_per_prompt_params(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(SQL)
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    outs = llm.generate([ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    assert outs[0].prompt_token_ids == ids


def test_chat_uses_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the answer


def test_chat_takes_a_template_and_continues_the_final_message(llm):
    """chat_template replaces the model's; continue_final_message leaves the last message open
    (no end-of-turn after it), with add_generation_prompt false; chat_template_kwargs and
    tools reach the template."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    tokenizer = llm.get_tokenizer()
    out = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0]
    assert tokenizer.decode(out.prompt_token_ids) == "[user] Count\n[assistant] 1, 2,\n"
    kept_open = llm.chat(
        messages,
        params,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert tokenizer.decode(kept_open.prompt_token_ids).endswith("<|im_start|>assistant\n1, 2,")
    variables = (
        "{{ preface }}|{% for t in tools %}{{ t['function']['name'] }};{% endfor %}|"
        "{{ messages[-1]['content'] }}"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    out = llm.chat(
        messages,
        params,
        use_tqdm=False,
        chat_template=variables,
        chat_template_kwargs={"preface": "P"},
        tools=[tool],
    )[0]
    assert tokenizer.decode(out.prompt_token_ids) == "P|get_weather;|1, 2,"
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set"):
        llm.chat(messages, params, chat_template_kwargs={"tokenize": False})


def test_allowed_token_ids_and_truncated_prompts(llm):
    """allowed_token_ids: every token drawn from the set (greedy: the best of it, as the
    logits masked by hand pick); truncate_prompt_tokens: the prompt's last k tokens only, its
    output the same as for those tokens given alone."""
    tokenizer = llm.get_tokenizer()
    allowed = tokenizer.encode(" yes no maybe")
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, max_tokens=6, allowed_token_ids=allowed, ignore_eos=True
        )
        out = llm.generate(["Is the sky blue?"], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6 and set(out.token_ids) <= set(allowed)
    ids = tokenizer.encode(SQL)
    cut = llm.generate(
        [SQL], SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=7), use_tqdm=False
    )[0]
    assert cut.prompt_token_ids == ids[-7:] and cut.prompt is None
    alone = _greedy(llm, {"prompt_token_ids": ids[-7:]}, max_tokens=5)
    assert cut.outputs[0].token_ids == alone.token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    for bad in ({"allowed_token_ids": []}, {"truncate_prompt_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(use_beam_search=True, temperature=0, logit_bias={5: 1.0})


def test_logprobs_are_vllms_logprob_objects(llm):
    """Each logprob is a Logprob with .logprob, .rank and .decoded_token, as vLLM's, and the
    float itself: greedy tokens rank 1, the top entries 1..N in order, a prompt token one more
    than the tokens more likely than it; the texts are the tokens' own."""
    from llmserve import Logprob

    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate([SQL], params, use_tqdm=False)[0]
    for token_id, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert all(isinstance(lp, Logprob) for lp in position.values())
        assert position[token_id].rank == 1  # greedy
        top = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((float(lp) for lp in top), reverse=True)
        for tid, lp in position.items():
            assert lp.decoded_token == tokenizer.decode([tid]) and lp.logprob == float(lp)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(p[t] for t, p in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))
    )
    assert out.prompt_logprobs[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        actual = position[token_id]
        better = [lp for lp in position.values() if lp.logprob > actual.logprob]
        assert actual.rank >= len(better) + 1 and (actual.rank > 2 or len(position) == 2)
    assert "Logprob(logprob=" in repr(out.outputs[0].logprobs[0])


def test_bad_words_are_never_generated(llm):
    """bad_words: the greedy answer's word never appears; each word is banned as written and
    with a leading space."""
    free = _greedy(llm, "The capital of France is", max_tokens=12)
    assert "Paris" in free.text
    banned = _greedy(llm, "The capital of France is", max_tokens=12, bad_words=["Paris"])
    assert "Paris" not in banned.text and banned.token_ids[0] != free.token_ids[0]
    tokenizer = llm.get_tokenizer()
    pairs = bad_words_token_ids(tokenizer, ["Paris"])  # as the engine tokenizes them
    assert tokenizer.encode("Paris", add_special_tokens=False) in pairs
    assert tokenizer.encode(" Paris", add_special_tokens=False) in pairs
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_detokenize_false_gives_tokens_only(llm):
    """vLLM's detokenize=False: the same tokens, no text; stop strings refused (they are
    matched in the text)."""
    expected = _greedy(llm, SQL)
    got = _greedy(llm, SQL, detokenize=False)
    assert got.token_ids == expected.token_ids and expected.text
    assert got.text == ""
    with pytest.raises(ValueError, match="set detokenize=True to use stop"):
        SamplingParams(stop=["\n"], detokenize=False)


def test_tokenizer_option_takes_another_tokenizer(llm, tmp_path):
    """LLM(tokenizer=DIR): the engine tokenizes (and templates chats) with DIR's tokenizer; one
    with more tokens than the model's vocabulary is refused at load."""
    tokenizer = llm.get_tokenizer()
    tokenizer.save_pretrained(tmp_path / "same")
    marked = AutoTokenizer.from_pretrained(tmp_path / "same")
    marked.chat_template = "MARK {{ messages[0]['content'] }}"
    marked.save_pretrained(tmp_path / "marked")
    other = LLM(tokenizer=str(tmp_path / "marked"), kv_cache_memory=32 << 20, max_model_len=128)
    out = other.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))[0]
    assert tokenizer.decode(out.prompt_token_ids) == "MARK hi"
    del other
    marked.add_tokens(["<|one-too-many|>"])
    marked.save_pretrained(tmp_path / "larger")
    with pytest.raises(ValueError, match="not this model's tokenizer"):
        LLM(tokenizer=str(tmp_path / "larger"), kv_cache_memory=32 << 20, max_model_len=128)


def test_streamed_text_handles_multibyte_characters(llm):
    out = _greedy(
        llm, "Translate to Korean and add emoji: I love you", max_tokens=40, min_tokens=40
    )
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_max_tokens_beyond_the_context_stops_at_its_end(llm):
    """As vLLM: a prompt that fits runs; generation ends at max_model_len ("length"). The
    prompt fills most of the context, so a few dozen tokens reach its end."""
    prompt = SQL + " word" * 420
    prompt_len = len(llm.get_tokenizer().encode(prompt))
    assert 400 < prompt_len < 500
    params = SamplingParams(max_tokens=5000, min_tokens=5000, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 512 - prompt_len
    assert_no_leaks(llm)


def test_requests_that_cannot_fit_are_refused_with_numbers(llm):
    with pytest.raises(ValueError, match=r"maximum context length is 512.*--max-model-len") as info:
        llm.generate(["word " * 600], SamplingParams(max_tokens=10), use_tqdm=False)
    assert "10 for the completion" in str(info.value)
    tiny = LLM(kv_cache_memory=4 * 16 * 46080, max_model_len=512)
    with pytest.raises(
        ValueError, match=r"needs \d+ KV cache blocks.*pool has 4 blocks.*--kv-cache-memory"
    ):
        tiny.generate([SQL], SamplingParams(max_tokens=200), use_tqdm=False)
    assert_no_leaks(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", SQL, SamplingParams(max_tokens=100, n=2))
    engine.step()
    engine.step()
    assert engine.block_manager.usage > 0
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_idle()


def test_output_kinds_of_the_engine_step(llm):
    """CUMULATIVE returns everything so far after each step, DELTA only what the step added,
    FINAL_ONLY one output at the end; all three end with the same text, tokens and logprobs.
    The prompt is shorter than a KV block, so no request reads another's cached prefix and the
    three greedy rows compute alike; the stop string (never met) holds text back each step."""
    engine = llm.llm_engine
    kinds = list(RequestOutputKind)
    for kind in kinds:
        params = SamplingParams(
            temperature=0, max_tokens=24, logprobs=1, stop=["zzqx"], output_kind=kind
        )
        engine.add_request(kind.name, "Write a SQL query", params)
    outputs = {kind.name: [] for kind in kinds}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    cumulative, delta, final = (outputs[k] for k in ("CUMULATIVE", "DELTA", "FINAL_ONLY"))
    assert len(final) == 1 and final[0].finished
    assert len(cumulative) == len(delta) == 24 and cumulative[-1].finished and delta[-1].finished
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all(o.outputs[0].token_ids == cumulative[-1].outputs[0].token_ids[: i + 1]
               for i, o in enumerate(cumulative))  # fmt: skip
    assert "".join(o.outputs[0].text for o in delta) == texts[-1] == final[0].outputs[0].text
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 24
    joined = [t for o in delta for t in o.outputs[0].token_ids]
    assert joined == cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert [lp for o in delta for lp in o.outputs[0].logprobs] == final[0].outputs[0].logprobs
    assert len(delta[-1].outputs[0].text) >= 3  # the last 3 characters were held back until then
    engine.block_manager.check_idle()


def test_stream_interval_gathers_tokens_into_fewer_outputs(llm):
    """A request's stream_interval of 3 (above the engine's 1): its first output at once, then
    one every 3 new tokens, and the last when it finishes, CUMULATIVE and DELTA alike; the
    text and tokens end as without it."""
    engine = llm.llm_engine
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outputs: dict[str, list] = {"every": [], "by3": []}
        for name, interval in (("every", None), ("by3", 3)):
            params = SamplingParams(
                temperature=0, max_tokens=10, output_kind=kind, stream_interval=interval
            )
            engine.add_request(name, "Write a SQL query", params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id].append(output.outputs[0])
        every, by3 = outputs["every"], outputs["by3"]
        if kind is RequestOutputKind.DELTA:
            assert [len(o.token_ids) for o in by3] == [1, 3, 3, 3]
            assert "".join(o.text for o in by3) == "".join(o.text for o in every)
        else:
            assert [len(o.token_ids) for o in by3] == [1, 4, 7, 10]
            assert [o.text for o in by3] == [every[i].text for i in (0, 3, 6, 9)]
        assert len(every) == 10 and by3[-1].finish_reason == every[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0)
    engine.block_manager.check_idle()


def test_generate_asks_for_final_outputs_only_and_leaves_the_params_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    seen = []
    original_step = llm.llm_engine.step

    def step():
        outputs = original_step()
        seen.extend(outputs)
        return outputs

    llm.llm_engine.step = step
    try:
        result = llm.generate(["Write a SQL query", "Hello"], params, use_tqdm=False)
    finally:
        del llm.llm_engine.step
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert len(seen) == 2 and all(o.finished for o in seen)
    assert [len(r.outputs[0].token_ids) for r in result] == [8, 8]
