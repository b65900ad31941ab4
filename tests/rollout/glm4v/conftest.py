"""The rollout tests of the embedded GLM-4.1V (`tiny-glm4v`, fp32): in this folder `tiny_model_path` is that model,
and `hf`, `batch`, `hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they are this
folder's own: its HF reference, the same nine requests (GLM's chat template, one `<|image|>` per image) and HF's
greedy results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-glm4v"))


@pytest.fixture(scope="session")
def biasless_model_path(tiny_model_path, tmp_path_factory) -> str:
    """The same model whose config.json lacks `attention_bias` in text_config (transformers' GLM-4.1V has the q/k/v
    biases whatever the config says; vLLM builds them only when it says so)."""
    folder = tmp_path_factory.mktemp("glm4v-biasless")
    for file in Path(tiny_model_path).iterdir():
        shutil.copy2(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["attention_bias"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)
