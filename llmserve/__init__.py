"""llmserve: an LLM inference and serving engine."""

from llmserve.llm import LLM
from llmserve.lora import LoRARequest
from llmserve.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from llmserve.structured_output import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "LoRARequest",
    "RequestOutputKind",
    "BeamSearchParams",
    "BeamSearchOutput",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]
