"""Rollout correction (engine vs trainer logprobs): weights, masks and metrics against references written here, and
verl's and TRL's functions (written out) and published cases: Token-TIS, IcePop, Seq-MIS, rejection sampling."""

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
@pytest.mark.parametrize("mode, seq_ratio, low, high", [("seq_mis", "product", 0.5, 2.0), ("seq_mis", "product", 0.7, 1.5),
                                                        ("seq_rs", "product", 0.5, 2.0), ("seq_rs", "geometric", 0.9, 1.1),
                                                        ("seq_rs", "product", 0.7, 1.5)])
def test_seq_mis_and_seq_rs_match_reference(seed, mode, seq_ratio, low, high):
    old, rollout, mask = random_gap(seed, gap=0.3)
    out = rollout_correction(old, rollout, mask, mode, seq_low=low, seq_high=high, seq_ratio=seq_ratio)
    assert not out.weights.requires_grad
    dropped, real = 0, 0
    for i in range(mask.shape[0]):
        keep = mask[i] != 0
        if not keep.any():
            assert (out.mask[i] == 0).all() and (out.weights[i] == 0).all()
            continue
        real += 1
        log_product = (old[i][keep] - rollout[i][keep]).sum().item()
        log_ratio = log_product / int(keep.sum()) if seq_ratio == "geometric" else log_product
        out_of_band = not low <= math.exp(log_ratio) <= high
        dropped += out_of_band
        assert torch.equal(out.mask[i], torch.zeros_like(mask[i]) if out_of_band else mask[i])
        weight = math.exp(log_product) if mode == "seq_mis" else 1.0  # Seq-MIS weighs a kept sequence by its ratio
        torch.testing.assert_close(out.weights[i], out.mask[i].double() * weight, rtol=1e-12, atol=0)
    assert 0 < dropped < real, "the case must drop some sequences and keep others"
    assert out.metrics["masked_seq_fraction"] == pytest.approx(dropped / real)
    tokens_dropped = int((mask.sum() - out.mask.sum()).item())
    assert out.metrics["masked_token_fraction"] == pytest.approx(tokens_dropped / mask.sum().item())
    kept = out.mask != 0
    assert out.metrics["weight_mean"] == pytest.approx(out.weights[kept].sum().item() / mask.sum().item())


def test_seq_mis_product_of_a_long_sequence_neither_overflows_nor_hides_its_drift():
    # 4096 tokens, each 0.0005 apart: the product exp(2.05) = 7.8 leaves [0.5, 2]; the geometric mean stays in
    # [0.999, 1.001]. Computed in log space, so neither needs exp() of a large sum.
    old = torch.zeros(2, 4096)
    rollout = torch.stack([torch.full((4096,), -0.0005), torch.full((4096,), 0.05)])  # row 1: product e^-204.8
    mask = torch.ones(2, 4096)
    product = rollout_correction(old, rollout, mask, "seq_mis")
    assert product.metrics["masked_seq_fraction"] == 1.0
    geometric = rollout_correction(old, rollout, mask, "seq_rs", seq_low=0.999, seq_high=1.001,
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
    with pytest.raises(ValueError, match="token_low"):
        rollout_correction(*args, "token_icepop", token_low=0.5, token_high=0.9)
    with pytest.raises(ValueError, match="use mode seq_rs"):
        rollout_correction(*args, "seq_mis", seq_ratio="geometric")
    assert ROLLOUT_CORRECTIONS == ("off", "token_tis", "token_icepop", "seq_mis", "seq_rs", "bypass")
    bypass = rollout_correction(*args, "bypass")  # the ratio itself corrects (fit.py anchors it): no weights here
    assert torch.equal(bypass.weights, (args[2] != 0).to(bypass.weights.dtype)) and bypass.mask is args[2]


def test_verl_mask_mode_case():
    # Mirrors volcengine/verl tests/trainer/ppo/test_rollout_corr.py test_mask_mode: 2 sequences of 5 tokens, the
    # trainer at -2.0 and the engine at -1.0 (ratio e^-1 = 0.37) or -2.5 (ratio e^0.5 = 1.65). verl computes token IS
    # weights (threshold 2.0) and rejects by a band of 0.5_2.0 in one call; we run one mode at a time: token_tis gives
    # the same weights, seq_rs (geometric, the same band: every token of a row has the same ratio) rejects the first
    # sequence only, half the tokens.
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    weights = rollout_correction(old, rollout, mask, "token_tis", token_cap=2.0).weights
    assert weights[0, 0].item() == pytest.approx(0.368, abs=0.01) and weights[1, 0].item() == pytest.approx(1.649,
                                                                                                         abs=0.01)
    rejected = rollout_correction(old, rollout, mask, "seq_rs", seq_low=0.5, seq_high=2.0, seq_ratio="geometric")
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


# --- Seq-MIS and IcePop against verl's and TRL's own functions -----------------------------------------------------


def verl_rollout_correction(old, rollout, mask, rollout_is, is_threshold, rollout_rs=None, rs_threshold=None):
    """verl-project/verl verl/trainer/ppo/rollout_corr_helper.py (1dda039) compute_rollout_correction_and_rejection_
    mask, written out for rollout_is in {None, "token", "sequence"} and rollout_rs in {None, "seq_sum_k1",
    "seq_mean_k1"}: (IS weights or None, the modified response_mask). is_threshold: a float (TIS) or "low_high"
    (IcePop); rs_threshold: "low_high". Its k1 is -log r, compared with [log low, log high] as in verl's code."""
    log_ratio = old - rollout
    weights = None
    if rollout_is is not None:
        if isinstance(is_threshold, str):
            lower, upper = (float(x) for x in is_threshold.split("_"))
        else:
            lower, upper = None, float(is_threshold)
        if rollout_is == "token":
            raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
        else:
            log_ratio_sum = (log_ratio * mask).sum(-1, keepdim=True)
            raw = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
        raw = raw * mask
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    new_mask = mask.clone()
    if rollout_rs is not None:
        lower, upper = (float(x) for x in rs_threshold.split("_"))
        token_k1 = -torch.clamp(log_ratio, min=-20.0, max=20.0)
        seq_stat = (token_k1 * mask).sum(-1)
        if rollout_rs == "seq_mean_k1":
            seq_stat = seq_stat / mask.sum(-1).clamp(min=1e-8)
        keep = (seq_stat >= math.log(lower)) & (seq_stat <= math.log(upper))
        new_mask = mask * keep.unsqueeze(-1).to(mask.dtype)
    return weights, new_mask


def trl_importance_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """huggingface/trl GRPOTrainer._generate_and_score_completions (trl f2cd577), its vLLM importance sampling
    written out: the ratio each token's loss is multiplied by ((B, T) for token_*, (B, 1) for sequence_*); TRL keeps
    the completion mask as it is."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


def clean_gap(seed: int, gap: float = 0.3):
    """random_gap with finite logprobs everywhere (the peers multiply by the mask: a NaN there would reach them)."""
    old, rollout, mask = random_gap(seed, gap=gap)
    return old, torch.where(mask != 0, rollout, old), mask.double()


def test_seq_mis_weighs_a_kept_sequence_by_its_ratio_as_verl_and_trl():
    # old logprobs [-2, -2], engine [-2.3, -2.1]: ratio e^0.4 = 1.4918, inside [0.5, 2]. verl's Seq-MIS preset and
    # TRL's sequence_mask both weigh the sequence 1.4918 (vlmrl weighed it 1.0 before); seq_rs keeps the 1.0.
    old = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    rollout = torch.tensor([[-2.3, -2.1]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    verl, verl_mask = verl_rollout_correction(old, rollout, mask, "sequence", 2.0, "seq_sum_k1", "0.5_2.0")
    trl = trl_importance_sampling_ratio(old, rollout, mask, "sequence_mask", 0.5, 2.0)
    ours = rollout_correction(old, rollout, mask, "seq_mis")
    assert ours.weights[0, 0].item() == pytest.approx(math.exp(0.4)) == pytest.approx(1.4918, abs=1e-4)
    torch.testing.assert_close(ours.weights, verl * verl_mask)
    torch.testing.assert_close(ours.weights, trl.expand_as(mask))
    assert torch.equal(rollout_correction(old, rollout, mask, "seq_rs").weights, mask)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("band, gap", [((0.5, 2.0), 0.3), ((0.8, 1.25), 0.1)])
def test_seq_mis_matches_verls_seq_mis_preset_and_trls_sequence_mask(seed, band, gap):
    # verl: decoupled_seq_is_rs = rollout_is="sequence" (TIS at is_threshold) + rollout_rs="seq_sum_k1" (band),
    # with is_threshold = the band's top (its default 2.0 for the default 0.5_2.0) the cap never binds on a kept row.
    # TRL: sequence_mask with clip_min / clip_max = the band. Symmetric bands (low = 1 / high), where verl's k1 test
    # and the ratio band agree (see the test below for an asymmetric one).
    low, high = band
    old, rollout, mask = clean_gap(seed, gap)
    ours = rollout_correction(old, rollout, mask, "seq_mis", seq_low=low, seq_high=high)
    verl, verl_mask = verl_rollout_correction(old, rollout, mask, "sequence", high, "seq_sum_k1", f"{low}_{high}")
    assert torch.equal(ours.mask, verl_mask), "the same sequences are kept"
    torch.testing.assert_close(ours.weights, verl * verl_mask, rtol=1e-12, atol=0)
    trl = trl_importance_sampling_ratio(old, rollout, mask, "sequence_mask", low, high) * mask
    # TRL zero-weights a dropped sequence but leaves it in the completion mask (and its loss normaliser); verl and
    # vlmrl take it out of the mask: the weights agree, the normaliser of token-mean differs by its tokens
    torch.testing.assert_close(ours.weights, trl, rtol=1e-12, atol=0)
    assert 0 < ours.metrics["masked_seq_fraction"] < 1


@pytest.mark.parametrize("seed", range(4))
def test_seq_rs_is_verls_rejection_without_is_weights(seed):
    # verl's rollout_rs alone (rollout_is=None): seq_sum_k1 (product) and seq_mean_k1 (Geo-RS, its 0.999_1.001)
    old, rollout, mask = clean_gap(seed)
    _, verl_mask = verl_rollout_correction(old, rollout, mask, None, None, "seq_sum_k1", "0.5_2.0")
    assert torch.equal(rollout_correction(old, rollout, mask, "seq_rs").mask, verl_mask)
    old, rollout, mask = clean_gap(seed, gap=0.002)
    _, verl_mask = verl_rollout_correction(old, rollout, mask, None, None, "seq_mean_k1", "0.999_1.001")
    geo = rollout_correction(old, rollout, mask, "seq_rs", seq_low=0.999, seq_high=1.001, seq_ratio="geometric")
    assert torch.equal(geo.mask, verl_mask) and torch.equal(geo.weights, verl_mask)


def test_the_band_bounds_the_ratio_as_verls_math_doc_and_trl_not_its_reciprocal_as_verls_code():
    # verl's docs/algo/rollout_corr_math.md: acceptance set C_lower <= prod_t rho_t <= C_upper; TRL masks a ratio
    # outside [clip_min, clip_max]. verl's compute_rollout_rejection_mask tests k1 = -log rho against
    # [log lower, log upper], i.e. lower <= 1 / rho <= upper. vlmrl bounds rho. On the asymmetric band [0.5, 1.5]:
    # rho = e^0.6 = 1.82 is out (1.82 > 1.5) by the doc, TRL and vlmrl, in by verl's code (1 / 1.82 = 0.55);
    # rho = e^-0.6 = 0.55 is in by the doc, TRL and vlmrl, out by verl's code (1 / 0.55 = 1.82 > 1.5).
    old = torch.zeros(2, 2, dtype=torch.float64)
    rollout = torch.tensor([[-0.3, -0.3], [0.3, 0.3]], dtype=torch.float64)  # rho = e^0.6, e^-0.6
    mask = torch.ones(2, 2, dtype=torch.float64)
    ours = rollout_correction(old, rollout, mask, "seq_rs", seq_low=0.5, seq_high=1.5)
    assert ours.mask[:, 0].tolist() == [0.0, 1.0]
    trl = trl_importance_sampling_ratio(old, rollout, mask, "sequence_mask", 0.5, 1.5)
    assert (trl[:, 0] != 0).tolist() == [False, True]
    _, verl_mask = verl_rollout_correction(old, rollout, mask, None, None, "seq_sum_k1", "0.5_1.5")
    assert verl_mask[:, 0].tolist() == [1.0, 0.0]
    # with a symmetric band the two readings agree
    _, verl_mask = verl_rollout_correction(old, rollout, mask, None, None, "seq_sum_k1", "0.5_2.0")
    assert torch.equal(rollout_correction(old, rollout, mask, "seq_rs").mask, verl_mask)


def test_verl_exact_icepop_case():
    # Mirrors verl tests/trainer/ppo/test_rollout_corr.py test_exact_icepop_zeroes_weights_without_changing_mask:
    # raw IS weights [0.4, 0.8, 6.0] with "0.5_5.0" -> [0, 0.8, 0], response_mask unchanged, 2/3 out of band
    raw = torch.tensor([[0.4, 0.8, 6.0]])
    mask = torch.ones_like(raw)
    out = rollout_correction(torch.zeros_like(raw), -torch.log(raw), mask, "token_icepop", token_low=0.5,
                             token_high=5.0)
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.8, 0.0]]), atol=1e-6, rtol=1e-6)
    assert torch.equal(out.mask, mask)
    assert out.metrics["zeroed_token_fraction"] == pytest.approx(2 / 3)
    assert out.metrics["masked_token_fraction"] == 0.0 and out.metrics["masked_seq_fraction"] == 0.0


def test_verl_icepop_with_the_ppo_loss_case():
    # Mirrors verl test_rollout_corr_integration.py test_exact_icepop_matches_filtered_weighted_ppo_loss: old
    # [-1, -1, -1], engine [-0.5, -3.5, -0.8] -> weights [e^-0.5, 0 (e^2.5 > 5), e^-0.2]; with logprobs = old the
    # token-mean PPO loss is mean(w * -A), its normaliser all 3 tokens (the mask is unchanged)
    from vlmrl.algorithms.aggregation import agg_loss
    from vlmrl.algorithms.policy_loss import ppo_clip_token_loss

    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-0.5, -3.5, -0.8]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones_like(old)
    out = rollout_correction(old, rollout, mask, "token_icepop")
    expected = torch.tensor([[0.60653067, 0.0, 0.81873075]])
    torch.testing.assert_close(out.weights, expected, atol=1e-6, rtol=1e-6)
    assert out.metrics["zeroed_token_fraction"] == pytest.approx(1 / 3)
    loss = agg_loss(ppo_clip_token_loss(old.clone(), old, adv, out.mask).loss_mat * out.weights, out.mask)
    torch.testing.assert_close(loss, torch.mean(expected * -adv), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("band", [(0.5, 5.0), (0.8, 1.2)])
def test_token_icepop_matches_verl_and_trls_token_mask(seed, band):
    low, high = band
    old, rollout, mask = clean_gap(seed, gap=1.0)
    ours = rollout_correction(old, rollout, mask, "token_icepop", token_low=low, token_high=high)
    verl, verl_mask = verl_rollout_correction(old, rollout, mask, "token", f"{low}_{high}")
    torch.testing.assert_close(ours.weights, verl, rtol=1e-12, atol=0)
    assert torch.equal(ours.mask, mask) and torch.equal(verl_mask, mask)
    trl = trl_importance_sampling_ratio(old, rollout, mask, "token_mask", low, high) * mask
    torch.testing.assert_close(ours.weights, trl, rtol=1e-12, atol=0)
    zeroed = ((verl == 0) & (mask != 0)).sum().item() / mask.sum().item()
    assert 0 < zeroed < 1 and ours.metrics["zeroed_token_fraction"] == pytest.approx(zeroed)


def test_token_icepop_band_is_inclusive_and_survives_extreme_and_padded_logprobs():
    # ratios exactly at the bounds are kept (verl: >= low and <= high; TRL masks < min or > max); an engine -inf
    # (ratio e^+inf) or a huge gap is zeroed, never inf or NaN; a NaN under the mask's zeros is ignored
    old = torch.zeros(1, 6, dtype=torch.float64)
    rollout = torch.tensor([[math.log(2.0), -math.log(5.0), -math.inf, 50.0, 0.0, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    out = rollout_correction(old, rollout, mask, "token_icepop", token_low=0.5, token_high=5.0)
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 5.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64))
    assert out.metrics["zeroed_token_fraction"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("seed", range(3))
def test_token_tis_matches_trls_token_truncate(seed):
    old, rollout, mask = clean_gap(seed, gap=1.0)
    ours = rollout_correction(old, rollout, mask, "token_tis", token_cap=3.0)  # TRL's clip_max default 3.0
    trl = trl_importance_sampling_ratio(old, rollout, mask, "token_truncate", None, 3.0) * mask
    torch.testing.assert_close(ours.weights, trl, rtol=1e-12, atol=0)


def test_a_sequence_whose_extreme_tokens_cancel_once_clamped_is_rejected_by_its_true_ratio_as_trl():
    """Token log ratios [25, -21] (old - rollout): the sequence's ratio is e^4 ~ 55, far outside [0.5, 2]. vlmrl
    tests the band on the unclamped sum and drops it, as TRL's sequence_mask does (weight 0). verl clamps each token to
    +-20 before summing its k1 (20 - 20 = 0: inside the band) and keeps it, with its TIS weight capped at 2: a kept
    sequence whose own weight says it is far off-policy. The difference is deliberate (the module's docstring)."""
    old = torch.tensor([[-1.0, -30.0]], dtype=torch.float64)
    rollout = torch.tensor([[-26.0, -9.0]], dtype=torch.float64)  # old - rollout = [25, -21]
    mask = torch.ones(1, 2, dtype=torch.float64)
    verl, verl_mask = verl_rollout_correction(old, rollout, mask, "sequence", 2.0, "seq_sum_k1", "0.5_2.0")
    trl = trl_importance_sampling_ratio(old, rollout, mask, "sequence_mask", 0.5, 2.0)
    assert torch.equal(verl_mask, mask) and torch.equal(verl * verl_mask, torch.full_like(mask, 2.0)), "verl keeps it"
    assert float(trl) == 0.0, "TRL drops it"
    for mode in ("seq_mis", "seq_rs"):
        ours = rollout_correction(old, rollout, mask, mode)
        assert torch.equal(ours.mask, torch.zeros_like(mask)) and torch.equal(ours.weights, torch.zeros_like(mask))
        assert ours.metrics["masked_seq_fraction"] == 1.0 and torch.isfinite(ours.weights).all()
    # both extremes the same way (sum 45): dropped by all three, and nothing overflows
    same_way = rollout_correction(old, torch.tensor([[-26.0, -50.0]], dtype=torch.float64), mask, "seq_mis")
    assert torch.equal(same_way.mask, torch.zeros_like(mask)) and torch.isfinite(same_way.weights).all()
