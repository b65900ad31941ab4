"""Shared pieces for actor tests: the tiny model's processor and real synthetic rows (batches: tests/batches.py)."""

from __future__ import annotations

import pytest

from tests.batches import synthetic_rows as write_synthetic_rows


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    from vlmrl.processors import ProcessorConfig, load_processor

    return load_processor(tiny_model_path, ProcessorConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    return write_synthetic_rows(tmp_path_factory.mktemp("data"), train_size=32, val_size=8)
