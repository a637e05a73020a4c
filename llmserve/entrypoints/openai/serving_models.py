"""The model names the server answers to: the base model's (``--served-model-name``) and its
LoRA adapters' (``--lora-modules``, and ``POST /v1/load_lora_adapter`` where runtime updates
are allowed), as vLLM's ``OpenAIServingModels``. A request's ``model`` picks the adapter."""

from __future__ import annotations

import json
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import ErrorResponse, ModelCard, OpenAIModel
from llmserve.lora.request import LoRARequest, read_adapter_config

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, read as vLLM reads it


def parse_lora_modules(values: list[str]) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` values: ``name=path``, or JSON ``{"name": ..., "path": ...,
    "base_model_name": ...}``; (name, path, base model name) each."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                modules.append((item["name"], item["path"], item.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules {value!r}: JSON needs the keys name and path ({e})"
                ) from e
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: write name=path or a JSON object")
        modules.append((name, path, None))
    return modules


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


class ServingModels:
    """Base model names and adapters by name; adapters get ids 1, 2, ... as they come."""

    def __init__(self, base_names: list[str], max_lora_rank: int | None = None):
        self.base_names = base_names
        self.max_lora_rank = max_lora_rank  # None: LoRA is off
        self.loras: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter, its config checked (its weights load with its first request);
        ValueError where it cannot be served."""
        if self.max_lora_rank is None:
            raise ValueError("LoRA adapters need the server started with --enable-lora")
        if name in self.base_names or name in self.loras:
            raise ValueError(
                f"the name {name!r} is already served; adapters need names of their own"
            )
        read_adapter_config(path, self.max_lora_rank)
        lora = LoRARequest(name, self._next_id, os.path.abspath(path), base_model_name)
        self._next_id += 1
        self.loras[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise OpenAIError(
                f"no LoRA adapter is named {name!r}; loaded: {sorted(self.loras)}",
                status=404,
                param="lora_name",
                code="model_not_found",
            )

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name
        this server does not serve."""
        if name is None or name in self.base_names:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise OpenAIError(
                f"The model {name!r} does not exist; this server serves {self.names}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return lora

    def reply_name(self, name: str | None) -> str:
        """The ``model`` a reply carries: the adapter's name, else the first base name."""
        return name if name in self.loras else self.base_names[0]

    @property
    def names(self) -> list[str]:
        return [*self.base_names, *self.loras]

    def cards(self, root: str, max_model_len: int) -> list[ModelCard]:
        base = [ModelCard(id=n, root=root, max_model_len=max_model_len) for n in self.base_names]
        adapters = [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_names[0],
                max_model_len=max_model_len,
            )
            for lora in self.loras.values()
        ]
        return base + adapters


# ---- runtime updates (vLLM's routes, there only while VLLM_ALLOW_RUNTIME_LORA_UPDATING is set)
lora_router = APIRouter()
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404)}


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name decides


@lora_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw: Request) -> str:
    """Serve one more adapter under ``lora_name`` (its weights load with its first request)."""
    models: ServingModels = raw.app.state.llmserve.models
    try:
        models.add(request.lora_name, request.lora_path)
    except ValueError as e:
        raise OpenAIError(str(e), param="lora_path") from e
    return f"Success: LoRA adapter '{request.lora_name}' added successfully."


@lora_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw: Request) -> str:
    """Stop serving an adapter (requests already queued finish with it; the engine drops its
    weights as --max-cpu-loras makes room)."""
    raw.app.state.llmserve.models.remove(request.lora_name)
    return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
