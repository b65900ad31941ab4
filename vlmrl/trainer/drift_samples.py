"""The drift samples a step keeps: the fit loop's share of the drift artifact (`vlmrl.alignment.drift_artifact`):
which samples of a step are kept, the trainer's pre-update logprobs of their tokens, and the records written for them.

The per-step `mismatch/*` metrics say how far trainer and engine are apart on a step; the artifact keeps a few
samples' tokens on both sides for the whole run, so a jump can be looked at sample by sample afterwards
(`python -m vlmrl.alignment.drift OUTPUT_DIR`).
"""

from __future__ import annotations

import random

import torch

from vlmrl.algorithms.mismatch import modality
from vlmrl.alignment.drift_artifact import DriftRecord
from vlmrl.batch.padding import upsample_to_multiple
from vlmrl.types import TrainBatch


def drift_rows(is_padding: torch.Tensor, fraction: float, seed: int, step: int) -> list[int]:
    """The rows of step `step`'s batch to keep: `fraction` of the real rows (rounded, at least one; none when
    fraction is 0), drawn by (seed, step) only, so a rerun or a resumed run keeps the same rows.

    >>> drift_rows(torch.tensor([False] * 40 + [True] * 8), 0.05, seed=1, step=3) == drift_rows(
    ...     torch.tensor([False] * 40 + [True] * 8), 0.05, seed=1, step=3)
    True
    >>> len(drift_rows(torch.tensor([False] * 40), 0.05, 1, 3)), len(drift_rows(torch.tensor([False] * 4), 0.05, 1, 3))
    (2, 1)
    """
    real = [i for i, padding in enumerate(is_padding.tolist()) if not padding]
    if fraction <= 0 or not real:
        return []
    count = min(len(real), max(1, round(fraction * len(real))))
    return sorted(random.Random(seed * 1_000_003 + step).sample(real, count))


def trainer_logprobs(actor, batch: TrainBatch, rows: list[int], old_logprobs: torch.Tensor | None, *,
                     eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """(len(rows), R) trainer logprobs of those rows before the update: the step's old logprobs when it computed
    them, else one forward over these rows only (padded to a multiple of the dp ranks: a sharded forward needs
    equal rows per rank)."""
    if old_logprobs is not None:
        return old_logprobs[rows]
    sub = upsample_to_multiple(batch.select(rows), actor.dp_size, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id)
    return actor.compute_logprobs(sub)[0][: len(rows)]


def drift_records(batch: TrainBatch, rows: list[int], trainer: torch.Tensor, *, step: int, engine_version: int,
                  temperature: float, max_staleness: int = 0) -> list[DriftRecord]:
    """One record per row: its loss tokens and both sides' logprobs of them. `trainer`: (len(rows), R)."""
    out = []
    for k, i in enumerate(rows):
        keep = batch.response_mask[i] > 0
        out.append(DriftRecord(
            step=step, uid=batch.uids[i], row=i,
            data_source=batch.data_sources[i] if batch.data_sources else "unknown",
            modality=modality(batch.multi_modal_inputs[i]), engine_weight_version=engine_version,
            trainer_weight_version=step - 1, token_ids=batch.response_ids[i][keep].tolist(),
            engine_logprobs=batch.rollout_logprobs[i][keep].double().tolist(),
            trainer_logprobs=trainer[k][keep].double().tolist(), temperature=temperature,
            max_staleness=max_staleness))
    return out
