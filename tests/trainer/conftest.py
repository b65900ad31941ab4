"""Shared pieces for trainer tests: the tiny model's processor, real synthetic rows, and real padded batches."""

from __future__ import annotations

import pytest
import torch

from vlmrl.batch.padding import pad_sample, prompt_inputs, stack_samples


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    from vlmrl.processors import ProcessorConfig, load_processor

    return load_processor(tiny_model_path, ProcessorConfig(max_prompt_length=64))


@pytest.fixture(scope="session")
def synthetic_rows(tmp_path_factory):
    from vlmrl.data import load_dataset

    dataset = load_dataset("synthetic", "train", synthetic_train_size=32, synthetic_val_size=8,
                           root=tmp_path_factory.mktemp("data"))
    return [dataset[i] for i in range(len(dataset))]


def make_batch(processor, rows, n: int, response_length: int = 6, prompt_length: int = 64, seed: int = 0,
               text_only_rows: tuple[int, ...] = ()):
    """A real TrainBatch: each row sampled `n` times with random (never banned) response tokens of random length,
    random rewards. Rows listed in text_only_rows lose their image (a text prompt in a VLM batch)."""
    gen = torch.Generator().manual_seed(seed)
    banned = set(processor.banned_token_ids)
    vocab = [t for t in range(100, 900) if t not in banned]
    samples = []
    for i, row in enumerate(rows):
        if i in text_only_rows:
            row = dict(row, prompt=[{"role": "user", "content": "Name a colour."}], images=[])
        request = processor.build_request(row, i)
        prompt = prompt_inputs(processor, request)
        for _ in range(n):
            length = int(torch.randint(1, response_length + 1, (1,), generator=gen))
            ids = [vocab[int(j)] for j in torch.randint(0, len(vocab), (length,), generator=gen)]
            sample = pad_sample(prompt, ids, prompt_length=prompt_length, response_length=response_length,
                                pad_token_id=processor.pad_token_id)
            sample.reward = float(torch.rand(1, generator=gen) > 0.5)
            samples.append(sample)
    return stack_samples(samples)
