"""Moved to ``llmserve.layers.attention_metadata`` (beside the layers that read it); this name
stays importable for code written against the old path."""

from llmserve.layers.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
