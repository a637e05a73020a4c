"""LoRA adapters: many fine-tunes of one base model served side by side, as vLLM's multi-LoRA.

A LoRA adapter (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``) changes a
linear layer ``y = x W^T`` into ``y = x W^T + s (x A^T) B^T`` with ``A: [r, in]``, ``B: [out,
r]`` and ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). The base weights stay as they
are (packed, quantized); each request names its adapter, or none, and one step's batch mixes
them: every wrapped layer adds the low-rank term of each adapter in the step to that
adapter's rows only (``layers.LoRALinear``).

    request.py   LoRARequest (vLLM's: lora_name, lora_int_id, lora_path), the adapter's
                 config read and checked (torch-free: the engine and the server use it)
    weights.py   a PEFT adapter's tensors placed on this model's (fused) linear layers
    layers.py    LoRALinear and the step's rows per adapter (LoRABatch)
    manager.py   the loaded adapters (a bounded LRU), the model's layers wrapped on demand

Switched on by ``--enable-lora`` (``LLM(enable_lora=True)``); ``--max-loras`` bounds the
adapters in one step (the scheduler holds back a request whose adapter would exceed it),
``--max-lora-rank`` the rank an adapter may have, ``--max-cpu-loras`` how many stay loaded.
The prefix cache keeps each adapter's blocks apart (the KV of one prompt differs by adapter).
"""

from llmserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
