"""The decoder every non-Llama family configures: embeddings -> layers -> norm -> LM head.

A family file (``gpt2.py``, ``gemma.py``, ...) subclasses ``DecoderLM`` with two things:
``build_spec(config)``, its Hugging Face config read into a ``DecoderSpec`` (refusing options
it cannot run; ``decoder_spec.py``), and ``RENAMES``, its checkpoint names mapped to ours.
Residual layouts:

    pre        h = x + attn(n1(x));            out = h + mlp(n2(h))          (GPT-2, Llama-likes)
    post       h = n1(x + attn(x));            out = n2(h + mlp(h))          (OPT-350m)
    parallel   out = x + attn(n1(x)) + mlp(n1(x))                            (GPT-J, Phi, Falcon)
    parallel2  out = x + attn(n1(x)) + mlp(n2(x))                            (NeoX, Falcon-40b)
    sandwich   h = x + n3(attn(n1(x)));        out = h + n4(mlp(n2(h)))      (Gemma 2 and 3)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import KVCache
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.layernorm import kernels_for, make_norm
from llmserve.layers.mlp import MLP
from llmserve.layers.module import Module
from llmserve.layers.moe import SparseMoE
from llmserve.layers.position import sinusoidal_positions
from llmserve.layers.self_attention import SelfAttention
from llmserve.models.decoder_spec import LAYOUTS, DecoderSpec, MoEConfig, require


class DecoderLayer(Module):
    def __init__(
        self, spec: DecoderSpec, index: int, max_model_len: int, backend: str, rope_cache: dict
    ):
        super().__init__()
        self.layout = spec.layout
        hidden = spec.hidden_size
        self.self_attn = SelfAttention(spec.attention[index], max_model_len, backend, rope_cache)
        mlp = spec.mlp[index]
        if isinstance(mlp, MoEConfig):
            self.mlp = SparseMoE(
                hidden,
                mlp.intermediate_size,
                mlp.num_experts,
                mlp.top_k,
                mlp.normalize_top_k,
                mlp.act,
            )
        else:
            self.mlp = MLP(
                hidden, mlp.intermediate_size, mlp.act, mlp.gated, mlp.bias, kernels_for(backend)
            )

        def norm() -> nn.Module:
            return make_norm(spec.norm, hidden, spec.norm_eps, spec.norm_bias, kernels_for(backend))

        self.attn_norm = norm()
        self.mlp_norm = None if spec.layout == "parallel" else norm()
        if spec.layout == "sandwich":
            self.attn_out_norm, self.mlp_out_norm = norm(), norm()

    def forward(self, positions, x, kv_cache: KVCache, meta: AttentionMetadata, keep=None):
        """x ``[T, hidden]`` -> ``[T, hidden]``; ``keep``: only those rows past attention (the
        last layer's output rows)."""

        def kept(t: torch.Tensor) -> torch.Tensor:
            return t if keep is None else t[keep]

        if self.layout == "pre":
            x = kept(x) + self.self_attn(positions, self.attn_norm(x), kv_cache, meta, keep)
            return x + self.mlp(self.mlp_norm(x))
        if self.layout == "post":
            x = self.attn_norm(kept(x) + self.self_attn(positions, x, kv_cache, meta, keep))
            return self.mlp_norm(x + self.mlp(x))
        if self.layout == "parallel":
            normed = self.attn_norm(x)
            attn = self.self_attn(positions, normed, kv_cache, meta, keep)
            return kept(x) + attn + self.mlp(kept(normed))
        if self.layout == "parallel2":
            attn = self.self_attn(positions, self.attn_norm(x), kv_cache, meta, keep)
            x = kept(x)
            return x + attn + self.mlp(self.mlp_norm(x))
        attn = self.self_attn(positions, self.attn_norm(x), kv_cache, meta, keep)
        x = kept(x) + self.attn_out_norm(attn)
        return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))


class DecoderLM(Module):
    """Decoder stack plus LM head; ``forward`` returns hidden states, ``compute_logits`` logits.

    Our parameter names: ``embed_tokens``, ``embed_positions``, ``embed_norm``,
    ``project_in``/``project_out``, ``layers.N.{attn_norm, mlp_norm, attn_out_norm,
    mlp_out_norm}``, ``layers.N.self_attn.{qkv_proj, o_proj, q_norm, k_norm}``,
    ``layers.N.mlp.{gate_up_proj | up_proj, down_proj}`` (or ``{gate, w13, w2}`` for MoE),
    ``norm``, ``lm_head``.
    """

    # (regex on the checkpoint name, our name or None to skip); the first match wins. Our
    # name may end in "#part" (q, k, v, gate, up) for a slice of a fused parameter, or in
    # "#E:part" / "#E" for expert E of a stacked MoE parameter.
    RENAMES: list[tuple[str, str | None]] = []

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError

    def __init__(self, config: Any, max_model_len: int, attention_backend: str = "torch"):
        super().__init__()
        self.config = config
        spec = self.spec = self.build_spec(config)
        self.tp_shard = getattr(config, "tp_shard", None)  # a tensor-parallel rank's share
        if self.tp_shard is not None:
            from llmserve.distributed.plan import rank_spec

            spec = self.spec = rank_spec(spec, self.tp_shard)
        require(spec.layout in LAYOUTS, f"layout {spec.layout!r}")
        embed_dim = spec.project_dim or spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, embed_dim)
        if spec.positions == "learned":
            if max_model_len > spec.max_positions - spec.position_offset:
                raise ValueError(
                    f"max_model_len {max_model_len} exceeds the model's "
                    f"{spec.max_positions - spec.position_offset} learned positions"
                )
            self.embed_positions = nn.Embedding(spec.max_positions, spec.hidden_size)
        elif spec.positions == "sinusoidal":
            table = sinusoidal_positions(
                max(spec.max_positions, max_model_len), spec.hidden_size, spec.position_offset
            )
            self.register_buffer("sinusoidal", table, persistent=False)
        if spec.embed_norm:
            self.embed_norm = make_norm(
                spec.norm, spec.hidden_size, spec.norm_eps, spec.norm_bias,
                kernels_for(attention_backend),
            )  # fmt: skip
        if spec.project_dim:
            self.project_in = nn.Linear(spec.project_dim, spec.hidden_size, bias=False)
            self.project_out = nn.Linear(spec.hidden_size, spec.project_dim, bias=False)
        rope_cache: dict = {}  # layers with the same RoPE share one cos/sin table
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, max_model_len, attention_backend, rope_cache)
            for i in range(len(spec.attention))
        )
        self.norm = None
        if spec.final_norm:
            self.norm = make_norm(
                spec.norm, spec.hidden_size, spec.norm_eps, spec.norm_bias,
                kernels_for(attention_backend),
            )  # fmt: skip
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head = nn.Linear(embed_dim, spec.vocab_size, bias=spec.lm_head_bias)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> hidden states ``[T, hidden]`` (or ``project_dim``;
        ``[num_outputs, ...]`` where ``meta.output_rows`` names the rows wanted)."""
        spec = self.spec
        x = self.embed_tokens(input_ids)  # [T, embed_dim]
        if spec.embed_scale is not None:
            x = x * torch.tensor(spec.embed_scale, dtype=x.dtype)
        if spec.project_dim:
            x = self.project_in(x)  # [T, hidden]
        if spec.positions == "learned":
            x = x + self.embed_positions(positions + spec.position_offset)
        elif spec.positions == "sinusoidal":
            x = x + self.sinusoidal[positions].to(x.dtype)
        if spec.embed_norm:
            x = self.embed_norm(x)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(positions, x, kv_cache, meta, meta.output_rows if i == last else None)
        if self.norm is not None:
            x = self.norm(x)
        if spec.project_dim:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, hidden]`` at the positions that sample -> ``[N, vocab]``."""
        logits = self.lm_head(hidden)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- weights -------------------------------------------------------------------------
    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A family's layout change of one checkpoint tensor (Conv1D transpose, head order)."""
        return tensor

    def target(self, hf_name: str) -> str | None:
        """Our name (with its ``#part``) for a checkpoint name; None: not a weight we use."""
        for pattern, ours in self.RENAMES:
            if re.fullmatch(pattern, hf_name):
                return None if ours is None else re.sub(pattern, ours, hf_name)
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.target(hf_name)
            if name is None:
                continue
            name, _, part = name.partition("#")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} -> {name!r}: no such parameter")
            tensor = self.cut_for_rank(hf_name, self.convert(hf_name, tensor))
            dest = self._slice(params[name], name, part)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {missing[:8]}")

    def cut_for_rank(self, hf_name: str, tensor):
        """A checkpoint tensor (float, or quantized rows in our order) cut to this rank's share
        under tensor parallelism (``distributed/weights.py``); as it is otherwise."""
        if self.tp_shard is None:
            return tensor
        from llmserve.distributed.weights import cut_for_rank

        name, _, part = self.target(hf_name).partition("#")
        return cut_for_rank(name, part, tensor, self.tp_shard)

    def _slice(self, param: torch.Tensor, name: str, part: str) -> torch.Tensor:
        """The rows of ``param`` that a checkpoint part fills (all of it for no part)."""
        if not part:
            return param
        if part.isdigit():  # "#E": the whole of expert E
            return param[int(part)]
        if ":" in part:  # "#E:gate": a part of expert E
            expert, part = part.split(":")
            param = param[int(expert)]
        if part in ("gate", "up"):
            half = param.shape[0] // 2
            return param[:half] if part == "gate" else param[half:]
        attn = self.get_submodule(name.split(".qkv_proj")[0])
        start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[part]
        rows = attn.q_size if part == "q" else attn.kv_size
        return param[start : start + rows]

    # ---- quantized checkpoints (gguf, gptq, awq; see quantization/loading.py) -------------
    def quantized_placement(
        self, hf_name: str, num_rows: int
    ) -> tuple[str | None, int | None, torch.Tensor | None]:
        """Where a quantized ``[out, in]`` checkpoint weight goes: (our parameter or None to
        skip, its part of a fused parameter as in ``shard_sizes`` or None, the order its rows
        are stored in or None). An expert's weight goes to its own layer,
        ``layers.L.mlp.experts13.E`` (gate, up) or ``experts2.E`` (down), which the loader
        makes by unstacking that mixture-of-experts layer."""
        name = self.target(hf_name)
        if name is None:
            return None, None, None
        name, _, part = name.partition("#")
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None, None, None
        if part.isdigit() or ":" in part:  # expert E of a stacked MoE parameter
            expert, _, part = part.partition(":")
            moe, _, stacked = name.removesuffix(".weight").rpartition(".")  # layers.L.mlp, w13
            name = f"{moe}.experts{stacked.removeprefix('w')}.{expert}.weight"
        shard = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}[part] if part else None
        return name, shard, self.row_order(hf_name, num_rows)

    def row_order(self, hf_name: str, num_rows: int) -> torch.Tensor | None:
        """The output rows ``convert`` reorders (fused q/k/v stored per head), as an index."""
        index = torch.arange(num_rows)
        order = self.convert(hf_name, index.unsqueeze(1)).squeeze(1)  # [rows, 1] -> [rows]
        return None if torch.equal(order, index) else order

    def shard_sizes(self, name: str) -> list[int]:
        """Rows of each checkpoint part of a fused parameter (q, k, v or gate, up)."""
        if ".qkv_proj" in name:
            attn = self.get_submodule(name.split(".qkv_proj")[0])
            return [attn.q_size, attn.kv_size, attn.kv_size]
        half = self.get_submodule(name.removesuffix(".weight")).out_features // 2
        return [half, half]
