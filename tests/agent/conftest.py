"""Agent test fixtures: the tiny model's processor, the scripted backend that plays the scripted conversations
(tests/agent/scripted.py) without a model, the tiny model taught those conversations (once per session), the HF
backend on it (once per module), and the HF model itself for reference forwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    """The tiny model's processor (the taught copy has the same tokenizer and processor files)."""
    from vlmrl.processors.loading import load_processor

    return load_processor(tiny_model_path)


@pytest.fixture(scope="module")
def scripted_backend(tiny_model_path, processor):
    """A backend that writes the taught model's turns, with no model behind it (tests.fakes.ScriptedBackend). Its
    calls take about as long as the HF backend's on the taught model, so turns batch as they do there."""
    from tests.agent.scripted import ScriptedModel
    from tests.fakes import ScriptedBackend

    with ScriptedBackend(tiny_model_path, ScriptedModel(processor), latency_s=0.05, max_model_len=1024) as backend:
        yield backend


@pytest.fixture(scope="session")
def taught_model_path(tiny_model_path, tmp_path_factory) -> str:
    from tests.agent.training import teach_model

    return teach_model(tiny_model_path, tmp_path_factory)


@pytest.fixture(scope="module")
def backend(taught_model_path):
    """The hf rollout backend on the taught model (the engine tests start their own engines)."""
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", taught_model_path, max_model_len=1024, timeout_s=120) as backend:
        yield backend


@pytest.fixture(scope="session")
def hf_model(taught_model_path):
    """The taught model in transformers, for reference forwards (read only)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(taught_model_path, dtype=torch.float32).eval()
