"""Fixtures of the rollout tests: the processor's request batch and the HF reference (one per session)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, build_batch

VIDEO_MODELS = ("tiny", "tiny-qwen3-vl")
"""The embedded model of each family the video contract (tests.rollout.video_helpers) runs on."""


@pytest.fixture(scope="session")
def hf(tiny_model_path):
    """The transformers reference backend (fp32). Tests that edit its weights restore them."""
    from vlmrl.rollout import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend


@pytest.fixture(scope="session")
def batch(hf):
    """Nine requests (0, 1 and 2 images of different sizes) built by vlmrl.processors from dataset rows."""
    return build_batch(hf.processor)


@pytest.fixture(scope="session")
def hf_greedy(hf, batch):
    """HF's greedy results for the batch (with top-5 logprobs): what every engine must reproduce."""
    return hf.generate(batch, GREEDY)


@pytest.fixture(scope="module", params=VIDEO_MODELS)
def video_model_path(request) -> str:
    """Each embedded family's model in turn (module scope: one engine per family at a time)."""
    from vlmrl.models import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def video_hf(video_model_path):
    """transformers (fp32) on the module's current model: the reference."""
    from vlmrl.rollout import get_backend

    with get_backend("hf", video_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend
