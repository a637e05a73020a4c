"""llmserve: an LLM inference and serving engine."""

from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
