"""After each step: detokenize new tokens, apply stopping rules, build ``RequestOutput``s.

Stopping rules, checked per new token (all but the length rules wait for ``min_tokens``):
a token in ``stop_token_ids``; EOS (unless ``ignore_eos``); a ``stop`` string anywhere in
the new text, matched across token boundaries (the text is cut before it); ``max_tokens``;
``max_model_len``; a structured-output grammar that admits no further token. While a request has stop strings, the last ``len(longest) - 1``
characters are held back from unfinished outputs, so a stream never shows the start of a
stop string that is then taken back.

Which outputs a step returns (``output_due``): every changed request's, but FINAL_ONLY ones
only when they finish, and with a stream interval of k > 1 (``--stream-interval``, or the
request's ``stream_interval`` where larger; vLLM's) a request's first output, then one for
every k new tokens, and its last: fewer, larger chunks for a server's streams to send.
"""

from __future__ import annotations

from llmserve.engine.scheduler_output import SampledSeq
from llmserve.engine.sequence import FinishReason, Request, Sequence
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind


def process_sample(
    sample: SampledSeq, eos_token_id: int | None, max_model_len: int
) -> FinishReason | None:
    """Record one new token on its sequence; return why the sequence stops, if it does.

    A verified speculative step brings several tokens of one sequence at once, all already in
    ``seq.token_ids``: each is judged at its own output length, and when one stops the
    sequence the tokens after it are dropped."""
    seq, token_id, num_output = sample.seq, sample.token_id, sample.num_output_tokens
    params = seq.request.params
    if sample.logprobs is not None:
        seq.logprobs.append(sample.logprobs)
        seq.cumulative_logprob += sample.logprobs.get(token_id, 0.0)
    can_stop = num_output >= params.min_tokens
    if can_stop and token_id in params.stop_token_ids:
        seq.stop_reason = token_id
        return FinishReason.STOP
    if can_stop and token_id == eos_token_id and not params.ignore_eos:
        return FinishReason.STOP
    delta = seq.detokenizer.append(token_id)
    seq.output_text += delta
    if can_stop and params.stop and _match_stop_string(seq, len(delta)):
        return FinishReason.STOP
    if seq.grammar is not None and seq.grammar.is_stopped():  # the output is complete
        return FinishReason.STOP
    if num_output >= seq.request.max_tokens or seq.num_prompt_tokens + num_output >= max_model_len:
        return FinishReason.LENGTH
    return None


def _match_stop_string(seq: Sequence, delta_len: int) -> bool:
    """Look for a stop string that ends in the newest text; cut the text if one is found."""
    params = seq.request.params
    text = seq.output_text
    for stop in params.stop:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            end = index + len(stop) if params.include_stop_str_in_output else index
            seq.output_text = text[:end]
            seq.stop_reason = stop
            return True
    return False


def output_due(request: Request, stream_interval: int) -> bool:
    """Whether a request that changed this step returns an output now (module doc);
    ``stream_interval``: the engine's. Counts the output as sent when it is due."""
    params = request.params
    if request.is_finished:
        return True
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return False
    interval = max(stream_interval, params.stream_interval or 1)
    if interval == 1:
        return True
    produced = max(seq.num_output_tokens for seq in request.seqs)
    if request.num_streamed_tokens and produced - request.num_streamed_tokens < interval:
        return False
    request.num_streamed_tokens = produced
    return True


def make_request_output(request: Request) -> RequestOutput:
    """A snapshot of everything the request produced so far; for a DELTA request, of what it
    produced since the last one (which this call then counts as sent)."""
    params = request.params
    if request.beam is not None:
        return _beam_output(request)
    holdback = max((len(s) for s in params.stop), default=1) - 1
    delta = params.output_kind is RequestOutputKind.DELTA
    outputs = []
    for seq in request.seqs[: len(request.seqs) if request.is_forked else 1]:
        text = seq.output_text
        if not seq.is_finished and holdback:
            text = text[: max(0, len(text) - holdback)]
        token_ids, logprobs = seq.output_token_ids, seq.logprobs  # the first a fresh list
        if delta:  # from where the last output ended
            sent_chars, sent_tokens = seq.num_sent_chars, seq.num_sent_tokens
            seq.num_sent_chars = max(sent_chars, len(text))
            seq.num_sent_tokens = seq.num_output_tokens
            text, token_ids, logprobs = (
                text[sent_chars:],
                token_ids[sent_tokens:],
                logprobs[sent_tokens:],
            )
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=list(logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
            )
        )
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=request.is_finished,
        prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs is not None else None,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
        metrics=vars(request.metrics).copy(),
    )


def _beam_output(request: Request) -> RequestOutput:
    """Beam search: the ranked results once finished, the live beams (no text) before."""
    results = request.beam.results
    if results is not None:
        outputs = [
            CompletionOutput(
                index=i,
                text=h.text,
                token_ids=list(h.token_ids),
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
            )
            for i, h in enumerate(results)
        ]
    else:
        live = [s for s in request.seqs if not s.is_finished]
        outputs = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
            )  # fmt: skip
            for i, s in enumerate(live)
        ]
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=results is not None,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
        metrics=vars(request.metrics).copy(),
    )
