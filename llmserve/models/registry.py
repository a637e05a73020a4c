"""Architecture name (``config.architectures[0]``) -> model class. One line per architecture."""

from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.models.bloom import BloomForCausalLM
from llmserve.models.falcon import FalconForCausalLM
from llmserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from llmserve.models.gpt2 import GPT2LMHeadModel
from llmserve.models.gpt_bigcode import GPTBigCodeForCausalLM
from llmserve.models.gpt_neox import GPTNeoXForCausalLM
from llmserve.models.gptj import GPTJForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.mixtral import MixtralForCausalLM
from llmserve.models.mpt import MptForCausalLM
from llmserve.models.opt import OPTForCausalLM
from llmserve.models.phi import PhiForCausalLM
from llmserve.models.phi3 import Phi3ForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from llmserve.models.xglm import XGLMForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "OPTForCausalLM": OPTForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "XGLMForCausalLM": XGLMForCausalLM,
}


def get_model_class(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {architectures}; supported: {sorted(MODEL_REGISTRY)}"
    )
