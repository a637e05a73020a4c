"""Builds the torch side of the engine: device, dtype, model weights, KV pool, model runner."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch

from llmserve.config import EngineConfig
from llmserve.layers.attention import has_eager_attention
from llmserve.layers.cpu_linear import can_pack, has_native_bf16, pack_linear_layers
from llmserve.loader import ResolvedModel, iter_weights
from llmserve.lora.manager import LoRAManager
from llmserve.memory import keep_freed_memory, release_freed_memory
from llmserve.models.registry import get_model_class
from llmserve.quantization import loading as quantization
from llmserve.quantization.linear import default_kernel as default_quant_kernel
from llmserve.quantization.linear import move_to_huge_pages as move_quantized_to_huge_pages
from llmserve.runner import kv_cache
from llmserve.runner.cuda_graph import CUDAGraphRunner
from llmserve.runner.model_runner import ModelRunner
from llmserve.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA; float32 on CPU, also where the CPU runs bf16 natively, since
    fp32 is exact against transformers and bf16 is not (docs/serving.md, "dtype on CPU")."""
    if name == "auto":
        if device.type == "cpu" and has_native_bf16():
            logger.info(
                "this CPU runs bf16 natively: --dtype bfloat16 is faster, at a fidelity cost "
                "(docs/serving.md); --dtype auto stays float32"
            )
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: Triton on CUDA; on CPU the C++ kernels (fp32 or bf16) when they build, else torch."""
    from llmserve.kernels import cpu as cpu_kernels
    from llmserve.kernels import is_triton_available

    native_ok = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if name == "auto":
        if device.type == "cuda" and is_triton_available():
            return "triton"
        return "cpp" if native_ok and cpu_kernels.available() else "torch"
    if name == "triton" and not is_triton_available():
        raise ValueError(
            "attention backend 'triton' needs triton and a CUDA GPU (or TRITON_INTERPRET=1); use --attention-backend torch"
        )
    if name == "cpp" and not native_ok:
        raise ValueError(
            f"attention backend 'cpp' runs on the CPU in float32 or bfloat16 (got {device.type}, {dtype}); "
            "use --attention-backend torch"
        )
    if name == "cpp" and not cpu_kernels.available():
        raise ValueError(
            "attention backend 'cpp' could not build its C++ kernel (is a C++ compiler installed? "
            "the log says why); use --attention-backend torch"
        )
    return name


def load_model(
    resolved: ResolvedModel,
    hf_config,
    config: EngineConfig,
    max_model_len: int,
    dtype,
    device,
    backend: str,
    select: Callable[[Iterator], Iterator] | None = None,
):
    """Instantiate the architecture and fill in its weights (or random ones for ``dummy``),
    quantized as ``--quantization`` (or the checkpoint) says. ``select``: applied to the
    checkpoint's (name, tensor) stream; a tensor-parallel rank passes its slicing, with
    ``hf_config`` its own smaller config."""
    method = quantization.resolve_quantization(config.model.quantization, resolved, device, dtype)
    select = select or (lambda stream: stream)
    model_class = get_model_class(hf_config)
    torch.manual_seed(config.model.seed)
    with torch.device(device), _without_random_init():  # every weight is loaded (or dummy) below
        model = model_class(hf_config, max_model_len, backend)
    kernel = default_quant_kernel(device, config.model.quantized_activations) if method else ""
    if method in quantization.RUNTIME_METHODS:
        quantization.check_runtime_shapes(model, method)
    if config.model.load_format == "dummy":
        for param in model.parameters():
            torch.nn.init.normal_(param.data, std=0.02)
    elif method in quantization.CHECKPOINT_METHODS:
        tensors = select(quantization.iter_quantized_checkpoint(resolved, method))
        quantized, biases, floats = quantization.split_quantized(tensors)
        quantization.install_quantized_weights(model, quantized, biases, kernel, method, device)
        model.load_weights(floats)
    else:
        model.load_weights(select(iter_weights(resolved)))
    model = model.to(dtype=dtype).eval()
    quantization.set_output_dtype(model, dtype)
    if method in quantization.RUNTIME_METHODS:
        options = {
            "llm_int8_threshold": config.model.llm_int8_threshold,
            "nf4_double_quant": config.model.nf4_double_quant,
        }
        quantization.quantize_model(model, method, options, kernel)
    if can_pack(device, dtype):
        pack_linear_layers(model, batch_size_hint=config.scheduler.max_num_seqs)
    if method and device.type == "cpu":
        moved = move_quantized_to_huge_pages(model)
        if moved:
            logger.info("quantized blocks: %.1f MiB in huge pages", moved / 2**20)
    release_freed_memory()  # the checkpoint's tensors and the copies made from them
    if device.type == "cpu":
        keep_freed_memory()  # the steps' activations reused, not faulted in again each step
    return model


@contextlib.contextmanager
def _without_random_init():
    """``nn.Linear`` and ``nn.Embedding`` allocate their weights without the random init the
    checkpoint overwrites (a second per model load of the default model on a slow host; a
    tensor the checkpoint lacks is refused by ``load_weights``). As transformers'
    ``no_init_weights``, the switch is process-wide while the model is built."""
    saved = torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = _no_init
    try:
        yield
    finally:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = saved


def _no_init(module: torch.nn.Module) -> None:
    pass


def create_runner(
    resolved: ResolvedModel,
    hf_config,
    config: EngineConfig,
    max_model_len: int,
    eos_token_id: int | None,
    drafter: tuple | None = None,
) -> tuple[ModelRunner, int, str]:
    """Load the model (and the speculative drafter, ``(resolved, hf_config)``), size and
    allocate the KV pool(s); returns (runner, num_blocks, log line)."""
    device = resolve_device(config.device.device)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = resolve_attention_backend(config.device.attention_backend, device, dtype)
    model = load_model(resolved, hf_config, config, max_model_len, dtype, device, backend)
    cache_dtype = kv_cache.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, backend)
    spec = kv_spec(model, hf_config, cache_dtype, config.cache.block_size)
    bytes_per_block = spec.bytes_per_block
    shared = drafter is not None and config.speculative.model is None  # the target, quantized
    if drafter is not None:  # its pool has as many blocks, read through the same tables
        draft_model = load_drafter(drafter, config, max_model_len, dtype, device, backend)
        draft_spec = kv_spec(draft_model, drafter[1], cache_dtype, config.cache.block_size)
        if not shared:
            bytes_per_block += draft_spec.bytes_per_block
    num_blocks = kv_cache.kv_cache_budget(config.cache, device) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block of {bytes_per_block} bytes; raise --kv-cache-memory "
            "or --gpu-memory-utilization"
        )
    caches = kv_cache.allocate(spec, num_blocks, device, backend)
    proposer = None
    if drafter is not None:
        draft_caches = (
            caches if shared else kv_cache.allocate(draft_spec, num_blocks, device, backend)
        )
        proposer = DraftModelProposer(
            draft_model, draft_caches, spec.block_size, device, backend, shares_target_kv=shared
        )
    graphs = None
    use_graphs = device.type == "cuda" and backend == "triton" and not config.device.enforce_eager
    if use_graphs and config.lora.enable_lora:
        logger.info("CUDA graphs off: LoRA adapters change the step's layers request by request")
        use_graphs = False
    if use_graphs and has_eager_attention(model, max_model_len):
        logger.info("CUDA graphs off: ALiBi, soft-capping or sliding windows run eager attention")
        use_graphs = False
    if use_graphs and not quantization.graph_capturable(model):
        logger.info(
            "CUDA graphs off: LLM.int8 picks its outlier columns from each input "
            "(--llm-int8-threshold 0 has none and keeps the graphs)"
        )
        use_graphs = False
    if use_graphs:
        graphs = CUDAGraphRunner(
            model, caches, config.scheduler.max_num_seqs, max_model_len, spec.block_size, device
        )
        graphs.capture()
    swap = make_swap_space(config, spec, device) if drafter is None else None
    runner = ModelRunner(
        model, caches, spec.block_size, device, eos_token_id, backend, graphs, proposer, swap
    )
    lora = config.lora
    if lora.enable_lora:
        capacity = lora.max_cpu_loras or lora.max_loras
        runner.lora = LoRAManager(model, lora.max_lora_rank, capacity, dtype, device)
    weights = quantization.describe_weight_bytes(quantization.weight_bytes_by_dtype(model))
    info = (
        f"model {resolved.display_name} on {device} ({dtype}, attention: {backend}); "
        f"{quantization.describe_quantization(model)}{weights}; "
        + kv_cache.describe(spec, num_blocks, max_model_len)
    )
    if swap is not None:
        info += f"; swap space {config.cache.swap_space:g} GiB ({swap.num_blocks} blocks)"
    if proposer is not None:
        draft = quantization.describe_weight_bytes(quantization.weight_bytes_by_dtype(draft_model))
        pool = (
            "the target's KV pool"
            if shared
            else f"its own KV pool of {num_blocks} blocks ({draft_spec.bytes_per_block} B each)"
        )
        info += (
            f"; draft model {drafter[0].display_name}: "
            f"{quantization.describe_quantization(draft_model)}{draft}, {pool}"
        )
    return runner, num_blocks, info


def make_swap_space(
    config: EngineConfig, spec: kv_cache.KVCacheSpec, device: torch.device
) -> kv_cache.SwapSpace | None:
    """The swap space of ``--preemption-mode swap`` (auto: on CPU, where copying a sequence's
    KV costs far less than computing its tokens again), or None (recompute)."""
    mode = config.scheduler.preemption_mode
    if mode == "recompute" or (mode == "auto" and device.type != "cpu"):
        return None
    num_blocks = int(config.cache.swap_space * (1 << 30)) // spec.bytes_per_block
    return kv_cache.SwapSpace(spec, num_blocks) if num_blocks > 0 else None


def kv_spec(model, hf_config, dtype, block_size: int) -> kv_cache.KVCacheSpec:
    attn = model.layers[0].self_attn
    return kv_cache.KVCacheSpec(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        dtype=dtype,
        block_size=block_size,
    )


def load_drafter(drafter, config: EngineConfig, max_model_len, dtype, device, backend):
    """The speculative drafter: another model, or the target with the draft's quantization."""
    resolved, hf_config = drafter
    spec = config.speculative
    model_options = dataclasses.replace(
        config.model, quantization=spec.quantization, speculative_config=None
    )
    draft_config = dataclasses.replace(config, model=model_options)
    return load_model(resolved, hf_config, draft_config, max_model_len, dtype, device, backend)
