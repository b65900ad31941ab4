"""Fixtures of the rollout tests: the processor's request batch and the HF reference (one per session)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, build_batch


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
