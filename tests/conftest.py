"""Shared test setup: engine markers skip with a reason when the engine is missing; one tiny model per session."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Engines on CPU (see README "CPU setup"): in-process vLLM, SGLang's CPU code paths; set before any engine import.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ENGINE_MODULES = {"vllm": "vllm", "sglang": "sglang", "ray": "ray"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, module in _ENGINE_MODULES.items():
            if marker in item.keywords and importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(reason=f"{module} is not installed (run `make test`, which installs it)"))


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models import ensure_built

    return str(ensure_built("tiny"))
