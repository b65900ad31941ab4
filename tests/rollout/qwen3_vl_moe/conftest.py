"""The rollout tests of the embedded Qwen3-VL-MoE (`tiny-qwen3-vl-moe`, fp32): in this folder `tiny_model_path` is
that model, and `hf`, `batch`, `hf_greedy` are tests/rollout/conftest.py's fixtures registered again here, so that they
are this folder's own: its HF reference (the one the family matrix's Qwen3-VL-MoE classes use, `References`), the same
nine requests and HF's greedy results."""

from __future__ import annotations

import pytest

from tests.rollout.conftest import batch, hf, hf_greedy  # noqa: F401 - registered again: this folder's own copies


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl-moe"))
