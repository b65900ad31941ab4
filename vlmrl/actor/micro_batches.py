"""Which rows share a forward: fixed row counts, or packs under a token budget (actor.micro_batch_tokens).

A micro-batch only changes what runs together, never the loss: every micro-batch divides by its MINI-batch's
normaliser (see `vlmrl.actor.core`), so any partition of a mini-batch's rows gives the same gradient.

Tokens a micro-batch costs are the tokens its forward processes:
  padded (the default): rows x (longest prompt + longest response), the trimmed (b, l) block `micro_batch` builds;
  packed (actor.padding_free): the sum of the rows' own lengths, nothing padded.
A row whose cost alone is over the budget gets a micro-batch of its own (and a warning): rows are never cut.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vlmrl.types import TrainBatch
from vlmrl.utils.partition import fewest_bins_under, karmarkar_karp
from vlmrl.utils.sequences import chunks

logger = logging.getLogger(__name__)


def row_spans(batch: TrainBatch) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) the attention mask holds in each row (both runs are contiguous in the
    (P, R) layout: `vlmrl.batch.padding`)."""
    p_len = batch.prompt_length
    prompt = batch.attention_mask[:, :p_len].sum(dim=1).tolist()
    response = batch.attention_mask[:, p_len:].sum(dim=1).tolist()
    return [(int(p), int(r)) for p, r in zip(prompt, response)]


def cost(spans: Sequence[tuple[int, int]], packed: bool) -> int:
    """Tokens one forward over these rows processes.

    >>> cost([(3, 2), (1, 4)], packed=True), cost([(3, 2), (1, 4)], packed=False)
    (10, 14)
    """
    if not spans:
        return 0
    if packed:
        return sum(p + r for p, r in spans)
    return len(spans) * (max(p for p, _ in spans) + max(r for _, r in spans))


def plan_micro_batches(spans: Sequence[tuple[int, int]], budget: int, packed: bool, min_count: int = 1,
                       groups: Sequence[object] | None = None) -> list[list[int]]:
    """Positions 0..len(spans)-1 grouped into micro-batches that each cost <= budget (a lone overlong row excepted),
    as few as found, at least `min_count` (<= len(spans); sharded ranks must run the same number of forwards).

    Packed: Karmarkar-Karp sets (`fewest_bins_under`: balanced sums, fewest sets that fit). Padded: rows sorted by
    response length (in bands of 256) and prompt length, cut into runs greedily, so each run pads to rows of about
    its own lengths.

    `groups` (a group key per position: the GRPO prompt a row samples): the rows of a group that fit the budget
    together are planned as one unit, so that they share their vision encoding (`vlmrl.actor.vision_share`); a group
    over the budget is planned row by row (its rows then share within each micro-batch they land in).

    >>> plan_micro_batches([(2, 2), (2, 1), (9, 9), (1, 1)], budget=8, packed=True)
    [[0], [1, 3], [2]]
    >>> plan_micro_batches([(2, 2), (2, 1), (2, 2), (1, 1)], budget=8, packed=True, groups="abab")
    [[0, 2], [1, 3]]
    """
    n = len(spans)
    if not 1 <= min_count <= max(n, 1):
        raise ValueError(f"min_count={min_count} must be in [1, {n}]")
    overlong = [i for i in range(n) if cost([spans[i]], packed) > budget]
    if overlong:
        logger.warning("%d row(s) of %s tokens are over actor.micro_batch_tokens=%d: each runs as a micro-batch of "
                       "its own (raise the budget to keep memory predictable)", len(overlong),
                       [sum(spans[i]) for i in overlong], budget)
    rest = [i for i in range(n) if i not in overlong]
    units = _units(rest, spans, budget, packed, groups)
    if packed:
        sets = fewest_bins_under([sum(sum(spans[i]) for i in unit) for unit in units], budget)
        plan = [[i for j in s for i in units[j]] for s in sets]
    else:
        plan, run = [], []
        # rows of about the same response length (256-token bands), and within a band of about the same prompt
        # length: a run pads to its longest prompt plus its longest response
        for unit in sorted(units, key=lambda u: (max(spans[i][1] for i in u) // 256, max(spans[i][0] for i in u),
                                                 u[0])):
            if run and cost([spans[j] for j in run + unit], packed) > budget:
                plan.append(run)
                run = []
            run += unit
        if run:
            plan.append(run)
    plan = plan + [[i] for i in overlong]
    return split_to_count([sorted(mb) for mb in plan], spans, min_count, packed)


def _units(rows: Sequence[int], spans: Sequence[tuple[int, int]], budget: int, packed: bool,
           groups: Sequence[object] | None) -> list[list[int]]:
    """What the planner places whole: each row alone, or with `groups` each group whose rows fit the budget
    together (its rows alone when they do not)."""
    if groups is None:
        return [[i] for i in rows]
    by_group: dict[object, list[int]] = {}
    for i in rows:
        by_group.setdefault(groups[i], []).append(i)
    units = []
    for members in by_group.values():
        units += [members] if cost([spans[i] for i in members], packed) <= budget else [[i] for i in members]
    return units


def split_to_count(plan: list[list[int]], spans: Sequence[tuple[int, int]], count: int, packed: bool
                   ) -> list[list[int]]:
    """`plan` with its costliest multi-row micro-batches halved until it holds `count` (splitting never raises a
    cost, so the budget still holds). Sharded ranks agree on the largest count and call this."""
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        splittable = [mb for mb in plan if len(mb) > 1]
        if not splittable:
            raise ValueError(f"cannot make {count} micro-batches of {sum(len(mb) for mb in plan)} rows")
        largest = max(splittable, key=lambda mb: cost([spans[i] for i in mb], packed))
        plan.remove(largest)
        half = len(largest) // 2
        plan += [largest[:half], largest[half:]]
    return plan


def micro_batch_rows(batch: TrainBatch, rows: Sequence[int], rows_per_micro_batch: int, budget: int, packed: bool,
                     min_count: int = 1, keep_groups: bool = False) -> list[list[int]]:
    """The micro-batches (batch row indices) of `rows`: fixed runs of `rows_per_micro_batch` when budget is 0 (a
    prompt's samples are adjacent rows), else token-budget packs (`plan_micro_batches`; `keep_groups`: a prompt's
    samples that fit together kept together, by their uids)."""
    rows = list(rows)
    if budget <= 0:
        return chunks(rows, rows_per_micro_batch)
    spans = row_spans(batch)
    local = [spans[i] for i in rows]
    groups = [batch.uids[i] for i in rows] if keep_groups else None
    return [[rows[j] for j in mb] for mb in plan_micro_batches(local, budget, packed, min(min_count, len(rows)),
                                                                groups)]


def balanced_row_blocks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 in world_size equal-size sets with token sums as equal as Karmarkar-Karp finds
    (verl/EasyR1 balance their dp ranks the same way); each set sorted.

    >>> balanced_row_blocks([100, 1, 1, 100], 2)
    [[0, 2], [1, 3]]
    """
    return karmarkar_karp(list(lengths), world_size, equal_size=True)


def row_lengths(batch: TrainBatch) -> list[int]:
    """Tokens (prompt + response) the attention mask holds in each row."""
    return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]


def padded_tokens(batch: TrainBatch, plan: Sequence[Sequence[int]], packed: bool) -> int:
    """Tokens the forwards of `plan` process in all (the benchmark's measure)."""
    spans = row_spans(batch)
    return sum(cost([spans[i] for i in mb], packed) for mb in plan)

