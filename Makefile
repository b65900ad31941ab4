# vlmrl — the front-door commands (see README.md):
#   make demo   set up the CPU environment and run the main job on the embedded default
#   make test   set up the CPU environment and run the test suite (what CI runs): every test but the `full` variants
#   make test-all   the same and the `full` variants (second seeds, second families and recipes of a learning run,
#                   the rest of the kill -9 resume matrix); run it before a change that touches what they cover
#   make test-fast   every test that needs no engine, no Ray, no GPU and is not slow (a few minutes)
VENV ?= .venv
PY   := $(VENV)/bin/python

# Two pytest workers (pytest-xdist), one per core of the 2-core CI machine: one process runs an engine test or a
# learning run at about one core on average (measured), so a second worker uses the other. Tests that share an engine
# or a Ray cluster stay together in one worker (tests/conftest.py, distribution_unit). More workers run more engines at
# once: raise WORKERS only with the cores and memory for it.
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25
FAST := not vllm and not sglang and not ray and not slow and not gpu and not full

.PHONY: setup demo test test-all test-fast bench
setup:
	VENV=$(VENV) bash scripts/setup_cpu.sh

demo: setup
	PYTHON=$(PY) bash examples/qwen2_5_vl_grpo.sh

test: setup
	$(PY) -m pytest tests -m "not full" $(PARALLEL)

test-all: setup
	$(PY) -m pytest tests $(PARALLEL)

test-fast: setup
	$(PY) -m pytest tests -m "$(FAST)" $(PARALLEL)

bench: setup
	$(PY) benchmarks/bench_position_ids.py
	$(PY) benchmarks/bench_postprocess.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_logprobs_memory.py
