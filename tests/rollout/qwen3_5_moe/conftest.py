"""The rollout tests of the embedded Qwen3.5-MoE (`tiny-qwen3.5-moe`, bfloat16: its CPU engines' only dtype): in
this folder `tiny_model_path` is that model, and `hf` (its transformers reference in bfloat16), `batch` and
`hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they are this folder's own."""

from __future__ import annotations

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3.5-moe"))
