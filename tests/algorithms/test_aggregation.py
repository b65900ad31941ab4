"""Loss aggregation modes: against a float64 reference written here, split invariance (micro-batches and ranks), and
the peers' published cases."""

from __future__ import annotations

import pytest
import torch

from vlmrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, loss_normaliser
from vlmrl.algorithms.policy_loss import ppo_clip_token_loss


def reference(loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int) -> float:
    """Each mode written out row by row in float64 python."""
    rows = []
    for values, keep in zip(loss.double().tolist(), mask.tolist(), strict=True):
        kept = [v for v, k in zip(values, keep, strict=True) if k]
        if kept:
            rows.append(kept)
    if not rows:
        return 0.0
    tokens = sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * max_len)


def random_batch(seed: int, rows: int, width: int, holes: bool = True):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[0] = width  # one full row, one empty row at least
    lengths[-1] = 0
    mask = (torch.arange(width) < lengths[:, None]).double()
    if holes:  # tool-turn holes inside responses (multi-turn)
        mask = mask * (torch.rand(rows, width, generator=gen) > 0.2)
    loss[mask == 0] = float("nan")  # whatever sits under the mask must not matter
    return loss, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed, rows, width", [(0, 8, 6), (1, 16, 33), (2, 3, 4096), (3, 1, 1), (4, 40, 2)])
def test_each_mode_matches_the_float64_reference(mode, seed, rows, width):
    loss, mask = random_batch(seed, rows, width)
    got = agg_loss(loss, mask, mode, max_response_length=width + 7)
    assert got.item() == pytest.approx(reference(loss, mask, mode, width + 7), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_no_token_anywhere_gives_zero(mode):
    assert agg_loss(torch.full((2, 3), float("nan")), torch.zeros(2, 3), mode).item() == 0.0


def split(rows: int, sizes: list[int]) -> list[slice]:
    assert sum(sizes) == rows
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("sizes", [[8], [1] * 8, [3, 5], [2, 2, 4], [7, 1]])
def test_micro_batches_sum_to_the_mini_batch(mode, sizes):
    loss, mask = random_batch(5, 8, 12)
    whole = agg_loss(loss, mask, mode, max_response_length=16)
    normaliser = loss_normaliser(mask, mode, max_response_length=16)
    parts = sum(agg_loss(loss[s], mask[s], mode, normaliser) for s in split(8, sizes))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("world, micro", [(2, 1), (2, 2), (4, 1), (8, 1)])
def test_ranks_averaging_their_gradients_give_the_single_process_gradient(mode, world, micro):
    # the loss of each token is -A * logprob, so d loss / d logprob is each token's weight in the aggregate
    loss, mask = random_batch(6, 8, 10)
    adv = torch.nan_to_num(loss)
    logprobs = torch.zeros(8, 10, dtype=torch.float64, requires_grad=True)
    agg_loss(-adv * logprobs, mask, mode, max_response_length=10).backward()
    single = logprobs.grad.clone()
    logprobs.grad = None
    normaliser = loss_normaliser(mask, mode, max_response_length=10) / world  # global count / world size
    per_rank = 8 // world
    rank_grads = []
    for rank in range(world):
        rows = range(rank * per_rank, (rank + 1) * per_rank)
        for start in range(rows.start, rows.stop, micro):  # this rank's micro-batches accumulate
            s = slice(start, min(start + micro, rows.stop))
            agg_loss(-adv[s] * logprobs[s], mask[s], mode, normaliser).backward()
        rank_grads.append(logprobs.grad.clone())
        logprobs.grad = None
    averaged = sum(rank_grads) / world  # what DDP/FSDP's all-reduce mean does (each rank only has its own rows)
    torch.testing.assert_close(averaged, single, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_rows_change_nothing(mode):
    loss, mask = random_batch(7, 6, 9)
    padded_loss = torch.cat([loss, torch.full((3, 9), float("inf"))])
    padded_mask = torch.cat([mask, torch.zeros(3, 9, dtype=mask.dtype)])
    assert agg_loss(padded_loss, padded_mask, mode, max_response_length=9).item() == \
        agg_loss(loss, mask, mode, max_response_length=9).item()


def test_dr_grpo_normaliser_is_constant_so_padding_width_does_not_matter():
    loss, mask = random_batch(8, 4, 5, holes=False)
    wide_loss = torch.cat([loss, torch.zeros(4, 11, dtype=loss.dtype)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(4, 11, dtype=mask.dtype)], dim=1)
    mode = "seq-mean-token-sum-norm"
    assert agg_loss(wide_loss, wide_mask, mode, max_response_length=32).item() == \
        pytest.approx(agg_loss(loss, mask, mode, max_response_length=32).item(), rel=1e-15)
    # without the constant the divisor is the padded width, which changes with the batch (verl's caveat)
    assert agg_loss(wide_loss, wide_mask, mode).item() != pytest.approx(agg_loss(loss, mask, mode).item())


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-sum")
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum", normaliser=1.0)


# --- peers' published cases ----------------------------------------------------------------------------------------

# Mirrors hiyouga/EasyR1 tests/test_loss_avg_mode.py (test_loss_avg_mode_with_micro_batches / _with_ranks /
# _with_empty_response): 8 responses of lengths LENGTHS in width 8, advantage (row + 1) * (-1)^row, logprobs = old
# = 0; the gradient with respect to each token's logprob must be the mode's weight times -A whatever the split.
# EasyR1's "token" is our token-mean and its "seq" our seq-mean-token-mean. EasyR1 runs its actor with a fake
# forward; here the same numbers go through our loss + aggregation directly.
LENGTHS = [1, 7, 2, 6, 5, 3, 8, 4]
WIDTH = 8


def easyr1_data(lengths: list[int]):
    mask = (torch.arange(WIDTH)[None, :] < torch.tensor(lengths)[:, None]).double()
    adv = torch.tensor([float(row + 1) * (-1) ** row for row in range(len(lengths))], dtype=torch.float64)
    return mask, adv[:, None] * mask


def easyr1_expected_grad(mode: str, lengths: list[int]) -> torch.Tensor:
    mask, adv = easyr1_data(lengths)
    tokens = mask.sum(-1, keepdim=True)
    if mode == "seq-mean-token-mean":
        weights = mask / tokens.clamp(min=1) / (tokens > 0).sum()
    else:
        weights = mask / mask.sum()
    return -adv * weights


def world_grad(mode: str, lengths: list[int], world: list[list[int]], micro: int) -> torch.Tensor:
    mask, adv = easyr1_data(lengths)
    normaliser = loss_normaliser(mask, mode) / len(world)
    grads = []
    for rows in world:
        logprobs = torch.zeros(len(lengths), WIDTH, dtype=torch.float64, requires_grad=True)
        for start in range(0, len(rows), micro):
            index = torch.tensor(rows[start : start + micro])
            out = ppo_clip_token_loss(logprobs[index], torch.zeros(len(index), WIDTH, dtype=torch.float64),
                                      adv[index], mask[index])
            agg_loss(out.loss_mat, mask[index], mode, normaliser).backward()
        grads.append(logprobs.grad)
    return sum(grads) / len(world)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", [8, 4, 1])
def test_easyr1_loss_avg_mode_with_micro_batches(mode, micro):
    grad = world_grad(mode, LENGTHS, [list(range(8))], micro)
    torch.testing.assert_close(grad, easyr1_expected_grad(mode, LENGTHS))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_easyr1_loss_avg_mode_with_ranks(mode):
    grad = world_grad(mode, LENGTHS, [[0, 2, 3, 5], [1, 4, 6, 7]], micro=2)
    torch.testing.assert_close(grad, easyr1_expected_grad(mode, LENGTHS))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_easyr1_loss_avg_mode_with_empty_response(mode):
    # a response without tokens gets no weight, so the other responses are not scaled down
    lengths = [1, 7, 2, 0, 5, 3, 8, 4]
    grad = world_grad(mode, lengths, [[0, 2, 3, 5], [1, 4, 6, 7]], micro=2)
    torch.testing.assert_close(grad, easyr1_expected_grad(mode, lengths))


def test_verl_agg_loss_conventions():
    # Mirrors volcengine/verl verl/trainer/ppo/core_algos.py agg_loss (its CPU tests have no aggregation case at the
    # snapshot read): token-mean = masked_sum / batch_num_tokens * dp_size, i.e. our normaliser global / dp_size;
    # seq-mean-* divide by the global count of sequences that have a token.
    loss, mask = random_batch(9, 6, 7, holes=False)
    loss = torch.nan_to_num(loss)
    dp, tokens = 2, mask.sum()
    verl_token_mean = (loss * mask).sum() / tokens * dp
    assert agg_loss(loss, mask, "token-mean", tokens / dp).item() == pytest.approx(verl_token_mean.item())
    seqs = (mask.sum(-1) > 0).sum()
    verl_seq_sum = (loss * mask).sum(-1).sum() / seqs
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(verl_seq_sum.item())
    # Deliberate difference: verl's seq-mean-token-sum-norm is sum / loss_scale_factor, with no division by the
    # number of sequences, so its scale grows with the batch. We divide by sequences * max_response_length as
    # the Dr. GRPO paper and TRL's loss_type="dr_grpo" do (below); ours times the sequence count is verl's.
    verl_norm = (loss * mask).sum() / 64
    ours = agg_loss(loss, mask, "seq-mean-token-sum-norm", max_response_length=64)
    assert (ours * seqs).item() == pytest.approx(verl_norm.item())


def test_trl_dr_grpo_and_bnpo_and_grpo_loss_types():
    # Mirrors huggingface/trl GRPOTrainer._compute_loss: loss_type "bnpo" = sum / tokens (our token-mean), "grpo" =
    # mean over sequences of each one's token mean (our seq-mean-token-mean), "dr_grpo" = sum / (B *
    # max_completion_length) (our seq-mean-token-sum-norm when no row is empty: TRL counts every row).
    loss, mask = random_batch(10, 5, 6, holes=False)
    mask[-1, :2] = 1.0  # every row has a token, as in TRL's batches
    loss = torch.where(mask != 0, torch.nan_to_num(loss), torch.zeros_like(loss))
    max_completion_length = 9
    bnpo = (loss * mask).sum() / mask.sum().clamp(min=1.0)
    grpo = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    dr_grpo = (loss * mask).sum() / (loss.size(0) * max_completion_length)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(bnpo.item())
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(grpo.item())
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm",
                    max_response_length=max_completion_length).item() == pytest.approx(dr_grpo.item())
