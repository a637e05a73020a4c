"""Model quality measurements: ``perplexity.py`` (sliding-window perplexity through the engine)
and ``text_source.py`` (the built-in pydoc text and its calibration / evaluation split)."""
