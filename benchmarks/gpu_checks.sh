#!/bin/bash
# The GPU checks in one call of the `device` tool (a lent H100/H200 with no package registry).
#
# Prepare here, once per session (both folders ignored through .git/info/exclude):
#   .whl/      pure-Python and cp312 wheels the device lacks: gguf fastapi starlette pydantic
#              pydantic_core uvicorn llguidance annotated-types typing-inspection
#              (pip download --no-deps --only-binary=:all: --python-version 3.12 ...)
#   .gpu/tok/  the default model's config and tokenizer (config.json, tokenizer*.json,
#              chat_template.jinja from `python -m llmserve.benchmarks.export_hf`)
# then: run(command="bash benchmarks/gpu_checks.sh", carry=[".whl", ".gpu"], timeout_s=560).
#
# Each step has its own time limit and writes under $OUT as it goes, so a cut-short run still
# returns what it finished. Order: CUDA tests, the AMX GEMM on the host CPU (where it has AMX:
# issue 17's Intel bf16 question), the attention/graphs table, agreement with transformers,
# the batch-1 decode profile (where a step's time goes: gpu_decode_profile.py).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
step() { echo "== $(date -u +%T) $*"; }

{
    step info; nvidia-smi; lscpu
    grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'amx|avx512_bf16|avx512_vnni' | xargs
    python3 -c "import torch, triton, transformers as t
print(torch.__version__, triton.__version__, t.__version__)"
    git log --oneline -1
} > "$OUT/info.txt" 2>&1

# The C++ CPU kernels build in the background while the GPU tests run.
(MAX_JOBS=8 python3 -c "from llmserve.kernels import cpu as c
from llmserve.kernels.cpu import quant as q
print('cpu', c.available(), 'quant', q.available(), 'bf16', c.has_bf16_gemm(),
      'amx', c.has_amx_gemm(), c.current_isa())" \
    > "$OUT/cpu_build.txt" 2>&1) &
build=$!

{
    step kernel tests on CUDA
    LLMSERVE_KERNEL_TEST_DEVICE=cuda timeout 170 python3 -m pytest -n 8 -p no:cacheprovider \
        tests/kernels -k "not cpu_kernels and not quant_gemm and not cpu_gemm"
    step CUDA graph tests
    timeout 60 python3 -m pytest -p no:cacheprovider tests/test_cuda_graph.py
} > "$OUT/cuda_tests.txt" 2>&1

wait $build
# (pyproject's addopts already hold one -q: a second would drop pytest's summary line)
{
    step "the C++ kernels' linkage (on 2026-11-29 this image linked a second libstdc++ in)"
    timeout 60 python3 -m pytest -p no:cacheprovider tests/kernels/test_kernel_linkage.py
} > "$OUT/cpu_linkage.txt" 2>&1
if grep -q amx_tile /proc/cpuinfo; then
    {
        step AMX tests
        timeout 60 python3 -m pytest -p no:cacheprovider tests/kernels/test_cpu_gemm_amx.py
        for amx in 0 1 0 1; do  # two CPUs, as this project's hosts have
            step decode step, batch 64 x 320, bf16, LLMSERVE_CPU_AMX_GEMM=$amx
            LLMSERVE_CPU_AMX_GEMM=$amx OMP_NUM_THREADS=2 timeout 40 taskset -c 0,1 python3 -m \
                llmserve.benchmarks.attention --skip-gpu --dtype bfloat16 --batch 64 \
                --contexts 320 --model .gpu/tok --load-format dummy --repeats 20
            step offline random 64 x 256/128, bf16, LLMSERVE_CPU_AMX_GEMM=$amx
            LLMSERVE_CPU_AMX_GEMM=$amx timeout 60 taskset -c 0,1 python3 -m \
                llmserve.entrypoints.cli bench throughput --workload random --num-prompts 64 \
                --input-len 256 \
                --output-len 128 --model .gpu/tok --load-format dummy --dtype bfloat16 \
                --device cpu --disable-tqdm
        done
        step bf16 linears, 2 threads
        timeout 100 taskset -c 0,1 python3 -m llmserve.benchmarks.fp32_linear --dtype bfloat16 \
            --rows 1 8 64 128 --threads 2 --layers 16 --budget-s 0.2
    } > "$OUT/amx.txt" 2>&1
fi

{
    step attention, decode bandwidth, CUDA graphs
    timeout 150 python3 -m llmserve.benchmarks.attention --skip-cpu --model .gpu/tok \
        --output-json "$OUT/attention.json"
} > "$OUT/attention.txt" 2>&1

{
    step against transformers, random 1B Llama, fp32
    python3 benchmarks/gpu_vs_transformers.py random-llama --output /tmp/r1b --tokenizer .gpu/tok \
        && timeout 120 python3 benchmarks/gpu_vs_transformers.py compare --model /tmp/r1b \
            --dtype float32 --output-json "$OUT/vs_transformers_fp32.json"
    step done
} > "$OUT/vs_transformers.txt" 2>&1

{
    step "batch-1 decode profile, random 1B Llama, bf16: host loop or kernels (MBU 0.25 in 11-29)"
    timeout 120 python3 benchmarks/gpu_decode_profile.py --model /tmp/r1b --dtype bfloat16 \
        --output-json "$OUT/decode_profile.json"
    step done
} > "$OUT/decode_profile.txt" 2>&1
