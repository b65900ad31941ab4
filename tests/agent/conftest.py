"""Agent test fixtures: the tiny model taught the scripted conversations (once per session), its processor, the HF
backend on it (once per module), and the HF model itself for reference forwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def taught_model_path(tiny_model_path, tmp_path_factory) -> str:
    from tests.agent.scripted import teach
    from vlmrl.processors import load_processor

    torch.set_num_threads(1)
    return str(teach(tiny_model_path, tmp_path_factory.mktemp("taught-tiny"), load_processor(tiny_model_path)))


@pytest.fixture(scope="session")
def processor(taught_model_path):
    from vlmrl.processors import load_processor

    return load_processor(taught_model_path)


@pytest.fixture(scope="module")
def backend(taught_model_path):
    """The hf rollout backend on the taught model (the engine tests start their own engines)."""
    from vlmrl.rollout import get_backend

    with get_backend("hf", taught_model_path, max_model_len=1024, timeout_s=120) as backend:
        yield backend


@pytest.fixture(scope="session")
def hf_model(taught_model_path):
    """The taught model in transformers, for reference forwards (read only)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(taught_model_path, dtype=torch.float32).eval()
