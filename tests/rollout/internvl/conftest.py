"""The rollout tests of the embedded InternVL3.5 (`tiny-internvl`, fp32): in this folder `tiny_model_path` is that
model, and `hf`, `batch`, `hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they are
this folder's own: its HF reference, the same nine requests (InternVL's chat template, one `<IMG_CONTEXT>` per image,
images cut into 1-5 tiles) and HF's greedy results."""

from __future__ import annotations

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-internvl"))
