"""Shared test setup: engine markers skip with a reason when the engine is missing, the gpu marker when there are not
enough CUDA devices; one tiny model per session."""

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
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            needed, found = gpu.kwargs.get("devices", 1), _cuda_devices()
            if found < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {found}: a CUDA-only "
                                                        "path, run on a GPU machine"))


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models import ensure_built

    return str(ensure_built("tiny"))
