"""Splitting work across data-parallel ranks and joining the results: pure functions over the typed records.

Every rank must receive the same number of rows (its forwards and backwards are collectives); the batch is made
divisible beforehand by padding rows (`vlmrl.batch.padding.upsample_to_multiple` to `required_batch_multiple`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmrl.actor.core import mini_batch_scales
from vlmrl.actor.micro_batches import balanced_row_blocks, row_lengths
from vlmrl.distributed.actor import UpdateShard
from vlmrl.types import TrainBatch
from vlmrl.utils.sequences import chunks, split_evenly


def even_row_blocks(num_rows: int, world_size: int) -> list[list[int]]:
    """Rows 0..num_rows-1 cut into world_size contiguous equal blocks; raises if they do not divide.

    >>> even_row_blocks(6, 2)
    [[0, 1, 2], [3, 4, 5]]
    """
    if num_rows % world_size:
        raise ValueError(f"{num_rows} rows do not split evenly over {world_size} data-parallel ranks: upsample the "
                         f"batch with padding rows (vlmrl.batch.padding.upsample_to_multiple) to a multiple of "
                         f"required_batch_multiple(dp_size={world_size}, ...)")
    return split_evenly(range(num_rows), world_size)


def update_row_blocks(num_rows: int, mini_batch_rows: int, world_size: int,
                      lengths: Sequence[int] | None = None) -> list[list[int]]:
    """For each rank, its rows of an update: the r-th equal slice of every mini-batch, mini-batch after mini-batch.

    Rank r's rows for mini-batch m are the r-th of world_size slices of rows [m * M, (m + 1) * M), M =
    mini_batch_rows; so every rank's optimizer step m sees its part of the same global mini-batch m. With `lengths`
    (tokens per row: token-budget micro-batches) the slices are not contiguous but balanced: equal row counts with
    token sums as equal as Karmarkar-Karp finds, so no rank waits for a rank with the long rows.

    >>> update_row_blocks(8, 4, 2)
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    >>> update_row_blocks(4, 4, 2, lengths=[9, 9, 1, 1])  # 10 tokens each
    [[0, 3], [1, 2]]
    """
    if num_rows % mini_batch_rows:
        raise ValueError(f"{num_rows} rows are not a whole number of mini-batches of {mini_batch_rows}: upsample the "
                         "batch with padding rows to required_batch_multiple(...)")
    if mini_batch_rows % world_size:
        raise ValueError(f"a mini-batch of {mini_batch_rows} rows does not split over {world_size} ranks: choose "
                         f"actor.ppo_mini_batch_size x rollout.n as a multiple of the dp size")
    blocks: list[list[int]] = [[] for _ in range(world_size)]
    for mini_batch in chunks(range(num_rows), mini_batch_rows):
        if lengths is None:
            parts = split_evenly(mini_batch, world_size)
        else:
            parts = [[mini_batch[j] for j in part]
                     for part in balanced_row_blocks([lengths[i] for i in mini_batch], world_size)]
        for rank, rows in enumerate(parts):
            blocks[rank].extend(rows)
    return blocks


def logprob_row_blocks(batch: TrainBatch, world_size: int, balanced: bool) -> list[list[int]]:
    """Each rank's rows of a logprob pass: equal contiguous blocks, or (balanced) equal counts of balanced tokens."""
    if not balanced:
        return even_row_blocks(len(batch), world_size)
    even_row_blocks(len(batch), world_size)  # the same error when the rows do not divide
    return balanced_row_blocks(row_lengths(batch), world_size)


def update_shards(batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                  ref_logprobs: torch.Tensor | None, mini_batch_rows: int, world_size: int,
                  loss_agg_mode: str = "token-mean", loss_weights: torch.Tensor | None = None,
                  balanced: bool = False) -> list[UpdateShard]:
    """One UpdateShard per rank (see `update_row_blocks`), each carrying every global mini-batch's loss normaliser
    (for `loss_agg_mode`) and token count.

    Args:
        batch: B rows, B a multiple of mini_batch_rows; its response_mask is the loss mask.
        old_logprobs: (B, R) or None (one optimizer step); advantages: (B,), or (B, R) per token (distillation);
            ref_logprobs: (B, R) or None.
        mini_batch_rows: rows per optimizer step (ppo_mini_batch_size x rollout.n).
        world_size: dp ranks; must divide mini_batch_rows.
        loss_agg_mode: actor.loss_agg_mode.
        loss_weights: (B, R) rollout-correction weights or None.
        balanced: give ranks balanced token totals (`update_row_blocks` with the rows' lengths).
    """
    blocks = update_row_blocks(len(batch), mini_batch_rows, world_size, row_lengths(batch) if balanced else None)
    normalisers, tokens = mini_batch_scales(batch.response_mask, mini_batch_rows, loss_agg_mode)
    return [
        UpdateShard(
            batch=batch.select(rows),
            old_logprobs=None if old_logprobs is None else old_logprobs[rows],
            advantages=advantages[rows],
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
            mini_batch_normalisers=[float(value) for value in normalisers],
            mini_batch_tokens=[float(value) for value in tokens],
            local_mini_batch=mini_batch_rows // world_size,
            loss_weights=None if loss_weights is None else loss_weights[rows],
        )
        for rows in blocks
    ]
