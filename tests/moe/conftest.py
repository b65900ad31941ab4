"""Fixtures of the MoE tests that start engines of their own (a run's checkpoint, compare end to end, the GPU's
routing capture): the embedded Qwen3-VL-MoE, its transformers reference and the request batch. The engine contract
of the MoE families is a line of the family matrix (tests/rollout/test_family_contract.py) and their engine-specific
tests are in tests/rollout/qwen3_vl_moe/ and tests/rollout/qwen3_5_moe/, on the session's shared engines."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import build_batch


@pytest.fixture(scope="session")
def qwen3_vl_moe_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl-moe"))


@pytest.fixture(scope="session")
def hf_qwen3_vl_moe(qwen3_vl_moe_path):
    """transformers (float32) on tiny-qwen3-vl-moe."""
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", qwen3_vl_moe_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend


@pytest.fixture(scope="session")
def moe_batch(hf_qwen3_vl_moe):
    """tests/rollout's nine requests (0, 1 and 2 images) through the MoE models' processor (both families share
    Qwen3-VL's)."""
    return build_batch(hf_qwen3_vl_moe.processor)


@pytest.fixture(scope="module")
def batch(moe_batch):
    return moe_batch
