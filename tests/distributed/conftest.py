"""Shared pieces for distributed tests: real padded batches from the tiny model's processor, and one local Ray
cluster per test module (with its own temp folder, torn down at the end of the module)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from vlmrl.batch import pad_sample, prompt_inputs, stack_samples
from vlmrl.types import TrainBatch


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    from vlmrl.processors import ProcessorConfig, load_processor

    return load_processor(tiny_model_path, ProcessorConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    from vlmrl.data import load_dataset

    dataset = load_dataset("synthetic", "train", synthetic_train_size=16, synthetic_val_size=4,
                           root=tmp_path_factory.mktemp("data"))
    return [dataset[i] for i in range(len(dataset))]


def make_batch(processor, rows, n: int, text_only_rows: tuple[int, ...] = (), response_length: int = 6,
               prompt_length: int = 64, seed: int = 0) -> TrainBatch:
    """A real TrainBatch: each row sampled `n` times with random (never banned) response tokens of random length,
    random 0/1 rewards and rollout logprobs near the trainer's. Rows in text_only_rows lose their image."""
    gen = torch.Generator().manual_seed(seed)
    banned = set(processor.banned_token_ids)
    vocab = [t for t in range(100, 900) if t not in banned]
    samples = []
    for i, row in enumerate(rows):
        if i in text_only_rows:
            row = dict(row, prompt=[{"role": "user", "content": f"Name colour number {i}."}], images=[])
        prompt = prompt_inputs(processor, processor.build_request(row, i))
        for _ in range(n):
            length = int(torch.randint(1, response_length + 1, (1,), generator=gen))
            ids = [vocab[int(j)] for j in torch.randint(0, len(vocab), (length,), generator=gen)]
            sample = pad_sample(prompt, ids, prompt_length=prompt_length, response_length=response_length,
                                pad_token_id=processor.pad_token_id)
            sample.reward = float(torch.rand(1, generator=gen) > 0.5)
            samples.append(sample)
    return stack_samples(samples)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster for this module only, in its own short temp folder (Unix socket paths are
    limited to ~107 characters, so not under pytest's deep tmp_path)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vlmrl-ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=True)
    try:
        yield temp_dir
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
