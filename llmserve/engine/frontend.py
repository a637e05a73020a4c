"""What the HTTP layer reads from an engine, without the model: ``EngineFrontend`` (tokenizer,
config, grammars, names). The server process holds one wherever the model runs elsewhere: in
the engine-core process (``core_client.py``) or in data-parallel replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.config import EngineConfig


@dataclass
class EngineFrontend:
    """What the server reads from an engine, without a model: tokenizer, config, names."""

    config: EngineConfig
    resolved: Any
    hf_config: Any
    tokenizer: Any
    grammars: Any
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""
    max_model_len: int = 0
    kv_info: str = ""

    @classmethod
    def load(cls, config: EngineConfig) -> EngineFrontend:
        from llmserve.loader import load_config, resolve_model, sampling_defaults
        from llmserve.structured_output.grammar import GrammarCompiler
        from llmserve.tokenizer import engine_tokenizer

        model = config.model
        resolved = resolve_model(model.model)
        hf_config = load_config(resolved)
        tokenizer = engine_tokenizer(
            resolved, model.tokenizer, hf_config.vocab_size, model.trust_remote_code
        )
        grammars = GrammarCompiler(tokenizer, hf_config.vocab_size, tokenizer.eos_token_id)
        defaults = sampling_defaults(resolved, model.generation_config)
        return cls(config, resolved, hf_config, tokenizer, grammars, defaults)

    def prompt_token_ids(self, prompt) -> tuple[str | None, list[int]]:
        """The prompt as the engine would tokenize it (``LLMEngine.tokenize``)."""
        from llmserve.tokenizer import tokenize_prompt

        return tokenize_prompt(self.tokenizer, prompt)
