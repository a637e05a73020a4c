"""Structured output: constrain generation to a JSON schema, a regex, a choice list or a grammar.

How it works, per sequence and step:

    request  --StructuredOutputsParams-->  grammar spec (compiled once, cached by spec)
    sequence --owns--> a matcher: the grammar's parser state after the tokens so far
    step     runner: each constrained row's allowed-token bitmask -> disallowed logits = -inf
             engine: the sampled token advances the matcher; a matcher that can take no more
             tokens ends the sequence (finish_reason "stop")

``params.py`` holds ``StructuredOutputsParams`` (vLLM's names: json, regex, choice, grammar,
json_object). ``grammar.py`` turns them into a grammar, validates it against the tokenizer
(a bad schema or regex is a ``ValueError`` before the request is queued) and makes matchers.

The grammar library is llguidance (Microsoft's Guidance engine, one of vLLM's structured-output
backends): it ships CPU wheels for every Python (abi3), computes a 49k-token mask in tens of
microseconds with no precomputation per grammar, covers JSON schema, regex and context-free
grammars (Lark syntax, and GBNF converted to Lark), and needs no torch, so matchers live on the
engine side (which stays torch-free) and only the runner touches tensors.
"""

from llmserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
