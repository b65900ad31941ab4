"""The rollout tests of the embedded Qwen3-VL (`tiny-qwen3-vl`, fp32): in this folder `tiny_model_path` is that model,
and `hf`, `batch`, `hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they are this
folder's own (one of each per session, on this model, apart from the Qwen2.5-VL ones): its HF reference, the same
nine requests and HF's greedy results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl"))


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
