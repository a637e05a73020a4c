"""Peers run on the same requests: same token ids, same output lengths, EOS ignored.

transformers        static batches of --hf-batch-size through ``model.generate`` (padding left):
                    every batch runs until its longest request is done (the naive baseline)
transformers-cb     transformers' own continuous batching (``init_continuous_batching``), when
                    the installed transformers has it
llama-cpp           llama-cpp-python on the GGUF file, one request at a time (its high-level API
                    does not batch requests), when installed

Throughput counts the requested output tokens only, so padding and the static batch's extra
tokens count as the cost they are.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from llmserve.benchmarks.metrics import throughput_result
from llmserve.benchmarks.workloads import BenchRequest

HF_PAGE_SIZE = 256  # transformers' default ContinuousBatchingConfig.page_size


class BackendUnavailable(RuntimeError):
    """A peer that cannot run here (package missing, feature absent); the message says why."""


def torch_device_dtype(device: str = "auto", dtype: str = "auto"):
    """The device and dtype llmserve itself would pick for these flags."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), getattr(torch, dtype)


def load_hf_model(model: str | None, device: str = "auto", dtype: str = "auto"):
    """The transformers reference model: from the GGUF file (dequantized) or the HF directory."""
    from transformers import AutoModelForCausalLM

    from llmserve.loader import resolve_model

    resolved = resolve_model(model)
    torch_device, torch_dtype = torch_device_dtype(device, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, dtype=torch_dtype
    )
    return hf_model.to(torch_device).eval()


def _generation_config(tokenizer, temperature: float, num_tokens: int | None = None, **extra):
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,  # masks EOS: exactly num_tokens new tokens
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **(sampling if temperature > 0 else {"do_sample": False}),
        **extra,
    )


def _left_pad(batch: Sequence[BenchRequest], pad_id: int, device):
    import torch

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, width - r.prompt_len :] = 1
    return input_ids.to(device), attention_mask.to(device)


def run_hf_static(
    model,
    tokenizer,
    requests: Sequence[BenchRequest],
    batch_size: int,
    temperature: float,
    use_tqdm: bool = True,
) -> dict:
    """Batches of ``batch_size`` in order, each padded left and run to its longest output."""
    import torch

    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    _hf_warmup(model, tokenizer, requests[0])
    torch.manual_seed(0)
    bar = tqdm(total=len(requests), desc="transformers (static)", unit="req", disable=not use_tqdm)
    num_generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            num_tokens = max(r.output_len for r in batch)
            input_ids, attention_mask = _left_pad(batch, tokenizer.pad_token_id, model.device)
            out = model.generate(  # [batch, width + num_tokens]
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=_generation_config(tokenizer, temperature, num_tokens),
            )
            num_generated += (out.shape[1] - input_ids.shape[1]) * len(batch)
            bar.update(len(batch))
    _synchronize(model.device)
    elapsed = time.perf_counter() - start
    bar.close()
    result = throughput_result(
        "transformers", requests, elapsed, sum(r.output_len for r in requests)
    )
    return result | {"hf_batch_size": batch_size, "generated_tokens": num_generated}


def _hf_warmup(model, tokenizer, request: BenchRequest) -> None:
    """Two tokens for a short prompt, so first-call costs stay out of the timing."""
    import torch

    warm = BenchRequest(request.prompt, request.prompt_token_ids[:8], 2)
    input_ids, attention_mask = _left_pad([warm], tokenizer.pad_token_id, model.device)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=_generation_config(tokenizer, 0.0, 2),
        )


def _cb_config(model, requests: Sequence[BenchRequest], kv_cache_memory: int | None):
    """On CPU, size transformers' paged cache to the workload (its default is most of RAM)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if model.device.type == "cuda":
        return ContinuousBatchingConfig()
    pages = sum(math.ceil((r.prompt_len + r.output_len) / HF_PAGE_SIZE) for r in requests) + 1
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page_bytes = 2 * 4 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * HF_PAGE_SIZE
    budget = max(2, (kv_cache_memory or 2**30) // page_bytes)
    return ContinuousBatchingConfig(num_blocks=min(pages, budget), max_batch_tokens=2048)


def run_hf_continuous(
    model,
    tokenizer,
    requests: Sequence[BenchRequest],
    temperature: float,
    kv_cache_memory: int | None = None,
    use_tqdm: bool = True,
) -> dict:
    """transformers' continuous batching: every request queued at once, EOS disabled."""
    if not hasattr(model, "init_continuous_batching"):
        import transformers

        raise BackendUnavailable(
            f"transformers {transformers.__version__} has no continuous batching "
            "(model.init_continuous_batching / generate_batch)"
        )
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # quiet per-run INFO
    gen_config = _generation_config(tokenizer, temperature, max(r.output_len for r in requests))
    gen_config.min_new_tokens = None  # EOS is off per request instead (eos_token_id=-1)
    bar = tqdm(
        total=len(requests), desc="transformers (continuous)", unit="req", disable=not use_tqdm
    )
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=_cb_config(model, requests, kv_cache_memory),
        warmup=model.device.type == "cuda",  # CUDA graph capture, outside the timing
    ) as manager:
        warm = BenchRequest(requests[0].prompt, requests[0].prompt_token_ids[:8], 2)
        _cb_generate(manager, [warm], "warmup", None)
        start = time.perf_counter()
        num_output = _cb_generate(manager, requests, "bench", bar)
        elapsed = time.perf_counter() - start
    bar.close()
    return throughput_result("transformers-cb", requests, elapsed, num_output)


def _cb_generate(manager, requests: Sequence[BenchRequest], prefix: str, bar) -> int:
    """Queue every request (EOS off), wait for all; returns the output tokens received."""
    for i, r in enumerate(requests):
        manager.add_request(
            r.prompt_token_ids,
            request_id=f"{prefix}-{i}",
            max_new_tokens=r.output_len,
            eos_token_id=-1,
        )
    num_done, num_output = 0, 0
    while num_done < len(requests):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            continue
        if result.is_finished():
            if result.error:
                raise RuntimeError(f"transformers continuous batching: {result.error}")
            num_done += 1
            num_output += len(result.generated_tokens)
            if bar is not None:
                bar.update(1)
    return num_output


def load_llama_cpp(model: str | None, device: str, n_ctx: int):
    """(the llama_cpp module, a Llama on the model's GGUF file), or BackendUnavailable."""
    try:
        import llama_cpp
    except ImportError:
        raise BackendUnavailable(
            "llama-cpp-python is not installed: pip install 'llmserve[llama-cpp]' "
            "(or pip install llama-cpp-python)"
        ) from None
    from llmserve.loader import resolve_model

    resolved = resolve_model(model)
    if resolved.kind != "gguf":
        raise BackendUnavailable(
            f"llama-cpp needs a GGUF model, {resolved.display_name} is not one"
        )
    use_gpu = torch_device_dtype(device)[0].type == "cuda"
    llm = llama_cpp.Llama(
        model_path=resolved.weights_path,
        n_ctx=n_ctx,
        n_batch=512,
        n_gpu_layers=-1 if use_gpu else 0,
        seed=0,
        verbose=False,
    )
    return llama_cpp, llm


def ban_tokens(llama_cpp, banned: list[int]):
    """A llama-cpp logits processor list that never samples ``banned`` (EOS: exact lengths)."""
    import numpy as np

    def ban(input_ids, scores):  # scores: [vocab] numpy
        scores[banned] = -np.inf
        return scores

    return llama_cpp.LogitsProcessorList([ban])


def run_llama_cpp(
    requests: Sequence[BenchRequest],
    model: str | None,
    temperature: float,
    banned_ids: set[int],
    device: str = "auto",
    use_tqdm: bool = True,
) -> dict:
    """llama-cpp-python on the GGUF file, one request after the other; EOS tokens banned."""

    n_ctx = max(r.prompt_len + r.output_len for r in requests) + 8
    llama_cpp, llm = load_llama_cpp(model, device, n_ctx)
    banned = sorted(banned_ids | {llm.token_eos()})
    llm.create_completion(prompt=requests[0].prompt_token_ids[:8], max_tokens=2)  # warm-up

    processors = ban_tokens(llama_cpp, banned)
    bar = tqdm(total=len(requests), desc="llama-cpp", unit="req", disable=not use_tqdm)
    num_output = 0
    start = time.perf_counter()
    for r in requests:
        out = llm.create_completion(
            prompt=r.prompt_token_ids, max_tokens=r.output_len, temperature=temperature,
            top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, logits_processor=processors,
        )  # fmt: skip
        num_output += out["usage"]["completion_tokens"]
        bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    return throughput_result("llama-cpp", requests, elapsed, num_output)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
