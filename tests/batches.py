"""Real inputs shared by the trainer and distributed tests: synthetic rows and padded TrainBatches built through the
tiny model's processor, exactly as the trainer builds them."""

from __future__ import annotations

import torch

from vlmrl.batch.padding import pad_sample, stack_samples
from vlmrl.types import TrainBatch


def synthetic_rows(root, train_size: int, val_size: int) -> list[dict]:
    """The synthetic training rows (images included) written under `root`."""
    from vlmrl.data.dataset import load_dataset

    dataset = load_dataset("synthetic", "train", synthetic_train_size=train_size, synthetic_val_size=val_size,
                           root=root)
    return [dataset[i] for i in range(len(dataset))]


def make_batch(processor, rows, n: int, text_only_rows: tuple[int, ...] = (), response_length: int = 6,
               prompt_length: int = 64, seed: int = 0) -> TrainBatch:
    """A real TrainBatch: each row sampled `n` times with random (never banned) response tokens of random length and
    random 0/1 rewards. Rows in text_only_rows lose their image (a text prompt in a VLM batch)."""
    gen = torch.Generator().manual_seed(seed)
    banned = set(processor.banned_token_ids)
    vocab = [t for t in range(100, 900) if t not in banned]
    samples = []
    for i, row in enumerate(rows):
        if i in text_only_rows:
            row = dict(row, prompt=[{"role": "user", "content": f"Name colour number {i}."}], images=[])
        prompt = processor.prompt_inputs(processor.build_request(row, i))
        for _ in range(n):
            length = int(torch.randint(1, response_length + 1, (1,), generator=gen))
            ids = [vocab[int(j)] for j in torch.randint(0, len(vocab), (length,), generator=gen)]
            sample = pad_sample(prompt, ids, prompt_length=prompt_length, response_length=response_length,
                                pad_token_id=processor.pad_token_id)
            sample.reward = float(torch.rand(1, generator=gen) > 0.5)
            samples.append(sample)
    return stack_samples(samples)


def sampled_student_batch(processor, rows) -> tuple[list, TrainBatch]:
    """Three prompts with their images, sampled twice each by the student (tiny) on hf, padded and stacked as a step
    does, with padding rows up to 8: (requests, batch). What a distillation teacher scores."""
    from vlmrl.batch.padding import pad_results, scored_batch
    from vlmrl.rollout.registry import get_backend
    from vlmrl.types import SamplingParams

    requests = [processor.build_request(row, i) for i, row in enumerate(rows[:3])]
    assert all(request.images for request in requests)
    with get_backend("hf", "tiny", dtype="float32", max_model_len=128) as student:
        results = student.generate(requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3))
    samples = pad_results([processor.prompt_inputs(r) for r in requests], results, prompt_length=64,
                          response_length=4, pad_token_id=processor.pad_token_id, policy_version=0)
    batch = scored_batch(samples, [0.0] * len(samples), [{}] * len(samples), multiple=8,
                         eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)
    assert int(batch.is_padding.sum()) == 2
    return requests, batch
