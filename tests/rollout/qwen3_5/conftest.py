"""The rollout tests of the embedded Qwen3.5 (`tiny-qwen3.5`, bfloat16: the only dtype its engines run on CPU): in
this folder `tiny_model_path` is that model, and `hf` (its transformers reference, in bfloat16: the family's CPU
engine dtype), `batch` and `hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they
are this folder's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3.5"))


def edited_copy(model_path: str, folder: Path, edit) -> str:
    """A copy of the model folder whose config.json `edit(config)` changed."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in Path(model_path).iterdir():
        shutil.copy2(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


@pytest.fixture(scope="session")
def bare_config_path(tiny_model_path, tmp_path_factory) -> str:
    """The same model whose config.json lacks the two keys only SGLang reads (full_attention_interval, an empty
    deepstack_visual_indexes) and the rope flag only the engines read (mrope_interleaved): transformers computes the
    same model; the engines would not, unless vlmrl tells them."""
    def strip(config):
        del config["text_config"]["full_attention_interval"]
        del config["vision_config"]["deepstack_visual_indexes"]
        del config["text_config"]["rope_parameters"]["mrope_interleaved"]

    return edited_copy(tiny_model_path, tmp_path_factory.mktemp("qwen3_5-bare"), strip)


@pytest.fixture(scope="session")
def misset_config_path(tiny_model_path, tmp_path_factory) -> str:
    """The model's config without the key an SGLang server starts without but then computes something else from
    (mrope_interleaved: it does not interleave the rope sections). Without deepstack_visual_indexes the server does
    not get that far: it assumes Qwen3-VL's deepstack and dies on its warm-up image (measured: index_copy_ shape
    error in _scatter_mm_embedding)."""
    def strip(config):
        del config["text_config"]["rope_parameters"]["mrope_interleaved"]

    return edited_copy(tiny_model_path, tmp_path_factory.mktemp("qwen3_5-misset"), strip)
