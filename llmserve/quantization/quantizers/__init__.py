"""llmserve's own post-training quantizers: float checkpoint in, GPTQ / AWQ checkpoint out.

config.py             QuantizeOptions (the CLI flags) and the checks made before any work
calibration.py        calibration sequences from the text (pydoc's first half or a file)
source_model.py       the float model (HF directory or GGUF) in a transformers model
decoder_stages.py     one decoder layer run stage by stage (inputs of each linear)
rtn.py                group round-to-nearest: the grid, and the baseline method
gptq.py               GPTQ (Hessian, Cholesky of H^-1, lazy batches, act-order)
replay.py             GPTQ for any family: the model run up to each layer
awq.py                AWQ (activation-aware scale search and folding, clipping search)
awq_groups.py         AWQ's scaling groups per family (which norm / linear feeds which)
awq_replay.py         AWQ for any family: each transformers layer called on its own inputs
checkpoint_writer.py  GPTQ v1 / AWQ gemm packing and the atomic directory write
pipeline.py           quantize(): the layer-by-layer loop
cli.py                ``llmserve quantize``
"""

from llmserve.quantization.quantizers.config import QuantizeOptions
from llmserve.quantization.quantizers.pipeline import QuantizeReport, quantize

__all__ = ["QuantizeOptions", "QuantizeReport", "quantize"]
