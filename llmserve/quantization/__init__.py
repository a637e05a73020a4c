"""Quantized weights at run time: one internal layout, one linear layer, one kernel per device.

    --quantization   what it does                                        stored as
    int8             W8: symmetric absmax per output channel              8-bit, G = K
    llm_int8         bitsandbytes LLM.int8: int8 x int8 matmul with        int8 + row scales
                     per-row scales of x and W, |x| >= threshold
                     features multiplied in full precision
    nf4 / fp4        bitsandbytes 4-bit: blocks of 64, absmax per block    4-bit + lut, G = 64
                     (--nf4-double-quant: absmax quantized again)
    gguf             a GGUF file's own blocks (Q4_0 Q4_1 Q8_0 Q4_K Q5_K    4-/8-bit, G 32 (16)
                     Q6_K), converted exactly, token table included
    gptq / awq       Hugging Face checkpoints, detected from               4-bit (2/3/4) or 8-bit
                     quantization_config: GPTQ v1/v2 with act-order,
                     AWQ gemm

Files: ``layout.py`` (``QuantizedWeight`` and the dequantize reference), ``linear.py``
(``QuantLinear`` / ``QuantEmbedding``: the C++ kernel on CPU, Triton on CUDA), ``loading.py``
(which layers are swapped, flag checks), one file per method's conversion (``int8.py``,
``llm_int8.py``, ``bnb_4bit.py``, ``gguf.py``, ``gptq.py``, ``awq.py``) and
``checkpoint_config.py`` / ``hf_checkpoint.py`` for reading GPTQ/AWQ directories.

Embeddings and the LM head stay in floating point for every method except ``gguf``, which
keeps the file's token table quantized and multiplies the tied LM head by the same blocks, as
llama.cpp does.

The checkpoint methods (gguf, gptq, awq) install into every model family: each model's
``quantized_placement`` maps a checkpoint weight to its layer through the family's own names
(fused q/k/v and gate/up parts, per-head qkv rows, GPT-2's Conv1D packed as a Linear).

Mixture-of-experts layers (Mixtral, Qwen3-MoE) are quantized expert by expert: every method
unstacks the layer's experts into one linear layer per expert and projection and swaps each
like any other (a GGUF file's stacked ``ffn_*_exps`` blocks are split per expert, a GPTQ/AWQ
checkpoint's ``experts.E.*`` layers placed one by one); the router stays float, and a
checkpoint that quantizes only some of a layer's experts is refused.

Own post-training quantizers (``quantizers/``: RTN, GPTQ, AWQ; ``llmserve quantize``) write
GPTQ / AWQ checkpoints that the ``gptq`` / ``awq`` rows above load, for every family (awq's
scaling groups per family: ``quantizers/awq_groups.py``; MoE experts stay float).
"""


def quantize(model=None, output=None, **options):
    """Quantize ``model`` into a GPTQ / AWQ checkpoint directory ``output`` (see
    ``llmserve.quantization.quantizers.pipeline.quantize``); returns a ``QuantizeReport``."""
    from llmserve.quantization.quantizers.pipeline import quantize as run

    return run(model, output, **options)
