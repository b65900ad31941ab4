"""Shared test setup: engine markers skip with a reason when the engine is missing, the gpu marker when there are not
enough CUDA devices; one tiny model per session."""

from __future__ import annotations

import importlib.util
import os

import pytest

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
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3.5"))


TINY_FAMILIES = ("tiny", "tiny-qwen3-vl", "tiny-qwen3.5")
"""One embedded model per supported family: Qwen2.5-VL, Qwen3-VL and Qwen3.5."""


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_family(request):
    """(model folder, its processor with prompts up to 64 tokens) for each embedded family in turn."""
    from vlmrl.data.config import DataConfig
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.qwen_vl import load_processor

    path = str(ensure_built(request.param))
    return path, load_processor(path, DataConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    """The tiny model's processor (prompts up to 64 tokens), shared by the actor, trainer and distributed tests."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.qwen_vl import load_processor

    return load_processor(tiny_model_path, DataConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    """Real synthetic rows written as parquet (tests/batches.py); tests/distributed/ uses a smaller set."""
    from tests.batches import synthetic_rows as write_synthetic_rows

    return write_synthetic_rows(tmp_path_factory.mktemp("data"), train_size=32, val_size=8)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the session's status once every report is written, without the interpreter's native teardown: as
    `vlmrl.train` does (`exit_without_native_teardown`), and for the same reason. After a whole suite the process
    holds the engines' and pyarrow's native thread pools; tearing them down at exit segfaulted once (status 139, on a
    fresh clone, after "1832 passed"), turning a green run red. atexit handlers still run, and output is flushed."""
    if not _EXIT_STATUS or os.environ.get("VLMRL_TEST_NATIVE_EXIT"):
        return
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
