"""Quantized weights at run time (package docstring completed below as methods land)."""
