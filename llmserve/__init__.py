"""llmserve: an LLM inference and serving engine."""

from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]
