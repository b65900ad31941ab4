"""Fixtures of the MoE engine tests: the embedded MoE models' transformers references and the request batch.

These tests live outside tests/rollout so that they run beside it (a unit of their own for the test workers); each
module starts its own engine, once, and closes it at the module's end."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, build_batch


def _hf(variant: str, dtype: str):
    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.registry import get_backend

    return get_backend("hf", str(ensure_built(variant)), dtype=dtype, max_model_len=1024, timeout_s=300)


@pytest.fixture(scope="session")
def qwen3_vl_moe_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl-moe"))


@pytest.fixture(scope="session")
def qwen3_5_moe_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3.5-moe"))


@pytest.fixture(scope="session")
def hf_qwen3_vl_moe():
    """transformers (float32) on tiny-qwen3-vl-moe. Tests that edit its weights restore them."""
    with _hf("tiny-qwen3-vl-moe", "float32") as backend:
        yield backend


@pytest.fixture(scope="session")
def hf_qwen3_5_moe():
    """transformers in bfloat16 on tiny-qwen3.5-moe (its engines' only dtype on CPU)."""
    with _hf("tiny-qwen3.5-moe", "bfloat16") as backend:
        yield backend


@pytest.fixture(scope="session")
def hf32_qwen3_5_moe():
    """transformers in float32 on tiny-qwen3.5-moe: how far bfloat16 alone moves transformers' own logprobs."""
    with _hf("tiny-qwen3.5-moe", "float32") as backend:
        yield backend


@pytest.fixture(scope="session")
def moe_batch(hf_qwen3_vl_moe):
    """tests/rollout's nine requests (0, 1 and 2 images) through the MoE models' processor (both families share
    Qwen3-VL's)."""
    return build_batch(hf_qwen3_vl_moe.processor)


@pytest.fixture(scope="session")
def hf_qwen3_vl_moe_greedy(hf_qwen3_vl_moe, moe_batch):
    return hf_qwen3_vl_moe.generate(moe_batch, GREEDY)


@pytest.fixture(scope="session")
def moe_videos(hf_qwen3_vl_moe, qwen3_vl_moe_path):
    """(seven video requests at 2 fps, one also holding an image; HF's greedy results) on tiny-qwen3-vl-moe."""
    from tests.rollout.video_helpers import video_batch

    requests = video_batch(qwen3_vl_moe_path, 2.0)
    return requests, hf_qwen3_vl_moe.generate(requests, GREEDY)


@pytest.fixture(scope="module")
def hf(request):
    """The module's transformers reference: Qwen3.5-MoE's (bfloat16) in a `qwen3_5_moe` module, else Qwen3-VL-MoE's."""
    return request.getfixturevalue("hf_qwen3_5_moe" if "qwen3_5_moe" in request.module.__name__ else "hf_qwen3_vl_moe")


@pytest.fixture(scope="module")
def batch(moe_batch):
    return moe_batch
