"""Agent test fixtures: the tiny model taught the scripted conversations (once per session), and the tools."""

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
