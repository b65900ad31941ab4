"""Rollout correction (engine vs trainer logprobs): weights, masks and metrics against references written here, and
verl's published rollout-correction cases."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.algorithms.correction import ROLLOUT_CORRECTIONS, rollout_correction


def random_gap(seed: int, rows: int = 7, width: int = 11, gap: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    rollout = old + gap * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).float() * (torch.rand(rows, width, generator=gen) > 0.1)
    mask[-1] = 0.0  # a padding row
    rollout[mask == 0] = float("nan")  # engines report nothing meaningful there
    return old, rollout, mask


def test_off_changes_nothing():
    old, rollout, mask = random_gap(0)
    out = rollout_correction(old, rollout, mask, "off")
    assert torch.equal(out.weights, mask.double()) and out.mask is mask
    assert out.metrics["weight_mean"] == 1.0 and out.metrics["masked_seq_fraction"] == 0.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [2.0, 1.2, 5.0])
def test_token_tis_matches_reference(seed, cap):
    old, rollout, mask = random_gap(seed)
    old = old.requires_grad_(True)
    out = rollout_correction(old, rollout, mask, "token_tis", token_cap=cap)
    assert not out.weights.requires_grad, "importance weights are constants of the loss"
    assert torch.equal(out.mask, mask)
    weights, truncated = [], 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                assert out.weights[i, t] == 0
                continue
            r = math.exp(old[i, t].item() - rollout[i, t].item())
            truncated += r > cap
            weights.append(min(r, cap))
            assert out.weights[i, t].item() == pytest.approx(min(r, cap), rel=1e-12)
    assert out.metrics["weight_mean"] == pytest.approx(sum(weights) / len(weights))
    assert out.metrics["weight_max"] == pytest.approx(max(weights))
    assert out.metrics["truncated_fraction"] == pytest.approx(truncated / len(weights))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_ratio, low, high", [("product", 0.5, 2.0), ("geometric", 0.9, 1.1),
                                                  ("product", 0.7, 1.5)])
def test_seq_mis_matches_reference(seed, seq_ratio, low, high):
    old, rollout, mask = random_gap(seed, gap=0.3)
    out = rollout_correction(old, rollout, mask, "seq_mis", seq_low=low, seq_high=high, seq_ratio=seq_ratio)
    dropped, real = 0, 0
    for i in range(mask.shape[0]):
        keep = mask[i] != 0
        if not keep.any():
            assert (out.mask[i] == 0).all()
            continue
        real += 1
        log_ratio = (old[i][keep] - rollout[i][keep]).sum().item()
        if seq_ratio == "geometric":
            log_ratio /= int(keep.sum())
        out_of_band = not low <= math.exp(log_ratio) <= high
        dropped += out_of_band
        assert torch.equal(out.mask[i], torch.zeros_like(mask[i]) if out_of_band else mask[i])
        assert torch.equal(out.weights[i], out.mask[i].double())
    assert 0 < dropped < real, "the case must drop some sequences and keep others"
    assert out.metrics["masked_seq_fraction"] == pytest.approx(dropped / real)
    tokens_dropped = int((mask.sum() - out.mask.sum()).item())
    assert out.metrics["masked_token_fraction"] == pytest.approx(tokens_dropped / mask.sum().item())


def test_seq_mis_product_of_a_long_sequence_neither_overflows_nor_hides_its_drift():
    # 4096 tokens, each 0.0005 apart: the product exp(2.05) = 7.8 leaves [0.5, 2]; the geometric mean stays in
    # [0.999, 1.001]. Computed in log space, so neither needs exp() of a large sum.
    old = torch.zeros(2, 4096)
    rollout = torch.stack([torch.full((4096,), -0.0005), torch.full((4096,), 0.05)])  # row 1: product e^-204.8
    mask = torch.ones(2, 4096)
    product = rollout_correction(old, rollout, mask, "seq_mis")
    assert product.metrics["masked_seq_fraction"] == 1.0
    geometric = rollout_correction(old, rollout, mask, "seq_mis", seq_low=0.999, seq_high=1.001,
                                   seq_ratio="geometric")
    assert torch.equal(geometric.mask[0], mask[0]) and (geometric.mask[1] == 0).all()


def test_rejects_unknown_modes_and_bad_bands():
    args = torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)
    with pytest.raises(ValueError, match="token_tis"):
        rollout_correction(*args, "seq_tis")
    with pytest.raises(ValueError, match="geometric"):
        rollout_correction(*args, "seq_mis", seq_ratio="mean")
    with pytest.raises(ValueError, match="seq_low"):
        rollout_correction(*args, "seq_mis", seq_low=1.5, seq_high=2.0)
    assert ROLLOUT_CORRECTIONS == ("off", "token_tis", "seq_mis")


def test_verl_mask_mode_case():
    # Mirrors volcengine/verl tests/trainer/ppo/test_rollout_corr.py test_mask_mode: 2 sequences of 5 tokens, the
    # trainer at -2.0 and the engine at -1.0 (ratio e^-1 = 0.37) or -2.5 (ratio e^0.5 = 1.65). verl computes token IS
    # weights (threshold 2.0) and rejects by a band of 0.5_2.0 in one call; we run one mode at a time: token_tis gives
    # the same weights, seq_mis (geometric, the same band) rejects the first sequence only, half the tokens.
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    weights = rollout_correction(old, rollout, mask, "token_tis", token_cap=2.0).weights
    assert weights[0, 0].item() == pytest.approx(0.368, abs=0.01) and weights[1, 0].item() == pytest.approx(1.649,
                                                                                                         abs=0.01)
    rejected = rollout_correction(old, rollout, mask, "seq_mis", seq_low=0.5, seq_high=2.0, seq_ratio="geometric")
    assert (rejected.mask[0] == 0).all() and (rejected.mask[1] == 1).all()
    assert rejected.metrics["masked_token_fraction"] == pytest.approx(0.5)


def test_verl_basic_truncation_case():
    # Mirrors volcengine/verl test_basic_rollout_correction's token-level truncate mode: batch 4 x 10, a 0.1-std
    # bf16-like gap, threshold 2.0: every weight is capped at 2.0 and the weights keep the logprobs' shape.
    torch.manual_seed(0)
    old = torch.randn(4, 10)
    rollout = old + torch.randn(4, 10) * 0.1
    out = rollout_correction(old, rollout, torch.ones(4, 10), "token_tis", token_cap=2.0)
    assert out.weights.shape == old.shape and out.weights.max() <= 2.0
    assert out.metrics["weight_max"] <= 2.0
