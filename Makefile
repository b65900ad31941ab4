# vlmrl — the two front-door commands (see README.md):
#   make demo   set up the CPU environment and run the main job on the embedded default
#   make test   set up the CPU environment and run the whole test suite (what CI runs)
VENV ?= .venv
PY   := $(VENV)/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export SGLANG_USE_CPU_ENGINE ?= 1

.PHONY: setup demo test bench
setup:
	VENV=$(VENV) bash scripts/setup_cpu.sh

demo: setup
	PYTHON=$(PY) bash examples/qwen2_5_vl_grpo.sh

test: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) benchmarks/bench_position_ids.py
	$(PY) benchmarks/bench_postprocess.py
	$(PY) benchmarks/bench_rollout.py
