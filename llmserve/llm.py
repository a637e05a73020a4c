"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from llmserve.engine.llm_engine import LLMEngine, PromptType
from llmserve.lora.request import LoRARequest
from llmserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from llmserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Runs batches of prompts through the engine; every engine option is a keyword.

    >>> llm = LLM(max_model_len=1024, kv_cache_memory=2**30)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.llm_engine = LLMEngine.from_kwargs(model=model, **engine_options)
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``);
        ``lora_request``: the LoRA adapter of all prompts, or one (or None) per prompt."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._per_prompt(sampling_params, len(prompts), SamplingParams, "SamplingParams")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        loras = self._per_prompt(
            lora_request, len(prompts), (LoRARequest, type(None)), "LoRA requests"
        )
        final_only: dict[int, SamplingParams] = {}  # each params once: prompts often share one
        request_ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            # only finished requests are returned: no per-step outputs of the others
            if id(p) not in final_only:
                final_only[id(p)] = replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            p = final_only[id(p)]
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.llm_engine.add_request(
                request_id, prompt, p, priority[i] if priority else 0, lora_request=loras[i]
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, inside the engine: a prompt's beams share its KV
        blocks and fork copy-on-write (engine/beam_search.py)."""
        outputs = self.generate(
            prompts, params.to_sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request
        )
        results = []
        for out in outputs:
            sequences = [
                BeamSearchSequence(
                    tokens=list(out.prompt_token_ids) + c.token_ids,
                    text=c.text,
                    cum_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / max(len(c.token_ids), 1) ** params.length_penalty,
                    finish_reason=c.finish_reason,
                )
                for c in out.outputs
            ]
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``, a Jinja template) to each
        conversation, then generate. ``continue_final_message`` (with
        ``add_generation_prompt=False``): the last message is left open and the output
        continues it (an assistant's reply begun by the caller). ``chat_template_kwargs``:
        more variables for the template (e.g. ``enable_thinking``); ``tools``: function
        definitions for templates that list them, as vLLM's ``LLM.chat`` takes them."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: pass "
                "add_generation_prompt=False to continue the last message"
            )
        from llmserve.tokenizer import reserved_template_kwargs  # transformers: not at import

        reserved = reserved_template_kwargs(chat_template_kwargs)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs cannot set {reserved}: they are chat()'s own arguments "
                "or the templating call's"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        extra: dict = dict(chat_template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if tools:
            extra["tools"] = tools
        prompts = [
            {
                "prompt_token_ids": tokenizer.apply_chat_template(
                    c,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    **extra,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            with engine.compute_threads_bound():
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    @staticmethod
    def _as_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # one prompt given as token ids
        return prompts

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, as vLLM's (a benchmark's cold start, say); True
        when nothing stayed cached."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: the model's
        generation_config.json's (``generation_config="auto"``), as vLLM's."""
        return self.llm_engine.default_sampling_params()

    @staticmethod
    def _per_prompt(value, num_prompts: int, one: type | tuple[type, ...], what: str) -> list:
        """``value`` for every prompt where it is ``one`` of its kind, else its list, checked to
        have one per prompt."""
        if isinstance(value, one):
            return [value] * num_prompts
        value = list(value)
        if len(value) != num_prompts:
            raise ValueError(f"got {len(value)} {what} for {num_prompts} prompts")
        return value
