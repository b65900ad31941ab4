"""The rollout tests of the embedded Qwen3-VL (`tiny-qwen3-vl`, fp32): in this folder `tiny_model_path` is that model,
and `hf`, `batch`, `hf_greedy` are its HF reference, the same nine requests and HF's greedy results (one of each
per session, apart from the Qwen2.5-VL ones of tests/rollout/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.rollout.helpers import GREEDY, build_batch


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models import ensure_built

    return str(ensure_built("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def hf(tiny_model_path):
    """transformers' Qwen3-VL (fp32): the reference. Tests that edit its weights restore them."""
    from vlmrl.rollout import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend


@pytest.fixture(scope="session")
def batch(hf):
    """Nine requests (0, 1 and 2 images of different sizes) built by the Qwen3-VL processor (multiples of 32)."""
    return build_batch(hf.processor)


@pytest.fixture(scope="session")
def hf_greedy(hf, batch):
    return hf.generate(batch, GREEDY)


@pytest.fixture(scope="session")
def flagless_model_path(tiny_model_path, tmp_path_factory) -> str:
    """The same model whose config.json lacks `mrope_interleaved` (a config from before the engines read it, or
    edited by hand): transformers still interleaves; vLLM and SGLang would not, unless vlmrl tells them."""
    folder = tmp_path_factory.mktemp("qwen3-vl-flagless")
    for file in Path(tiny_model_path).iterdir():
        shutil.copy2(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_interleaved"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)
