"""Policy losses (PPO-clip with dual-clip, GSPO, CISPO, SAPO): values, gradients and metrics against float64
references written here, and the peers' published formulas and cases."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.algorithms.aggregation import agg_loss
from vlmrl.algorithms.policy_loss import (
    POLICY_LOSS_FNS,
    POLICY_LOSSES,
    cispo_token_loss,
    gspo_token_loss,
    ppo_clip_token_loss,
    sapo_gate,
    sapo_token_loss,
)


def random_inputs(seed: int, rows: int = 6, width: int = 9, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    logprobs = old + spread * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).clone()
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).double()
    mask = mask * (torch.rand(rows, width, generator=gen) > 0.15)  # holes (tool tokens)
    mask[-1] = 0.0  # one row without a policy token
    return logprobs, old, adv, mask


def ref_ppo(lp: float, old: float, a: float, low: float, high: float, c: float | None):
    """(loss, d loss / d lp, which) for one token, written out."""
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
    loss, grad, which = (unclipped, -a * r, "none") if unclipped >= clipped else (clipped, 0.0, "clip")
    if c is not None and a < 0 and loss > -a * c:
        return -a * c, 0.0, "dual"
    return loss, grad, which if which == "none" else ("low" if a < 0 else "high")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("low, high, c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5), (0.2, 0.2, None)])
def test_ppo_clip_matches_reference_values_gradients_and_metrics(seed, low, high, c):
    lp, old, adv, mask = random_inputs(seed, spread=1.2)
    lp = lp.requires_grad_(True)
    out = ppo_clip_token_loss(lp, old, adv, mask, low, high, c)
    agg_loss(out.loss_mat, mask, "token-mean").backward()
    tokens = int(mask.sum())
    counts = {"low": 0, "high": 0, "dual": 0}
    ratios = []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                assert lp.grad[i, t] == 0
                continue
            loss, grad, which = ref_ppo(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), low, high, c)
            assert out.loss_mat[i, t].item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
            assert lp.grad[i, t].item() == pytest.approx(grad / tokens, rel=1e-12, abs=1e-14)
            counts[which] = counts.get(which, 0) + 1
            ratios.append(math.exp(lp[i, t].item() - old[i, t].item()))
    m = out.metrics
    assert m["clipfrac_low"].item() == pytest.approx(counts["low"] / tokens)
    assert m["clipfrac_high"].item() == pytest.approx(counts["high"] / tokens)
    assert m["dual_clip_fraction"].item() == pytest.approx(counts["dual"] / tokens)
    assert m["ratio_mean"].item() == pytest.approx(sum(ratios) / tokens)
    assert m["ratio_min"].item() == pytest.approx(min(ratios)) and m["ratio_max"].item() == pytest.approx(max(ratios))


def test_every_side_of_the_clip_is_counted_on_its_own():
    lp = torch.tensor([[0.5, -0.5, 2.0, 0.0, 0.5]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0]])
    m = ppo_clip_token_loss(lp, torch.zeros(1, 5), adv, torch.ones(1, 5)).metrics
    # token 0: high clip; token 1: low clip; token 2: e^2 > 3 with A < 0: dual; tokens 3, 4: nothing binds
    got = [m[key].item() for key in ("clipfrac_high", "clipfrac_low", "dual_clip_fraction")]
    assert got == pytest.approx([0.2, 0.2, 0.2])


def test_a_batch_without_tokens_has_finite_metrics_and_min_max_identities():
    out = ppo_clip_token_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert out.metrics["clipfrac_low"].item() == 0.0 and out.metrics["ratio_mean"].item() == 0.0
    assert out.metrics["ratio_min"].item() == math.inf and out.metrics["ratio_max"].item() == -math.inf


def seq_gspo_reference(lp, old, adv, mask, low, high):
    """Sequence-level GSPO (the paper's eq. 5 with its full gradient, no stop-gradient): per sequence
    -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp - old)), averaged over sequences that have tokens."""
    losses = []
    for i in range(mask.shape[0]):
        keep = mask[i] != 0
        if not keep.any():
            continue
        s = torch.exp((lp[i][keep] - old[i][keep]).mean())
        a = adv[i][keep][0]
        losses.append(-torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.05, 0.1), (0.2, 0.2)])
def test_gspo_token_equals_sequence_gspo_in_value_and_gradient(seed, low, high):
    # the paper: with one advantage per sequence, GSPO-token (stop-gradient form) is GSPO itself, value and gradient
    lp, old, adv, mask = random_inputs(seed, spread=0.05)
    lp_token = lp.clone().requires_grad_(True)
    lp_seq = lp.clone().requires_grad_(True)
    out = gspo_token_loss(lp_token, old, adv, mask, low, high, clip_ratio_c=None)
    ours = agg_loss(out.loss_mat, mask, "seq-mean-token-mean")
    ours.backward()
    ref = seq_gspo_reference(lp_seq, old, adv, mask, low, high)
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(lp_token.grad, lp_seq.grad, rtol=1e-10, atol=1e-14)


def test_gspo_ratio_is_the_sequence_geometric_mean_and_clips_whole_sequences():
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.3, -0.1, 0.1], [0.001, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9.0 is under the mask: it must not count
    out = gspo_token_loss(lp, old, torch.ones(2, 3), mask, 0.05, 0.05)
    s0, s1 = math.exp(0.1), math.exp(0.0005)
    assert out.metrics["ratio_max"].item() == pytest.approx(s0) and out.metrics["ratio_min"].item() == pytest.approx(s1)
    # sequence 0 (3 tokens) is clipped above, sequence 1 is inside: 3 of 5 tokens
    assert out.metrics["clipfrac_high"].item() == pytest.approx(3 / 5)
    assert out.loss_mat[0, 0].item() == pytest.approx(-1.05) and out.loss_mat[1, 0].item() == pytest.approx(-s1)


@pytest.mark.parametrize("seed", range(5))
def test_cispo_matches_reference_and_keeps_a_gradient_on_clipped_tokens(seed):
    lp, old, adv, mask = random_inputs(seed, spread=1.0)
    lp = lp.requires_grad_(True)
    low, high = 1.0, 0.2
    out = cispo_token_loss(lp, old, adv, mask, low, high)
    agg_loss(out.loss_mat, mask).backward()
    tokens = int(mask.sum())
    clipped = 0
    for i, t in (mask != 0).nonzero().tolist():
        r = math.exp(lp[i, t].item() - old[i, t].item())
        w = min(max(r, 1 - low), 1 + high)
        clipped += r > 1 + high
        assert out.loss_mat[i, t].item() == pytest.approx(-w * adv[i, t].item() * lp[i, t].item(), rel=1e-12)
        assert lp.grad[i, t].item() == pytest.approx(-w * adv[i, t].item() / tokens, rel=1e-12)
    assert clipped > 0, "the case must exercise the clip"
    assert out.metrics["clipfrac_high"].item() == pytest.approx(clipped / tokens)
    assert out.metrics["clipfrac_low"].item() == 0.0  # the floor is 0: a ratio is never below it


def test_registry_names_and_uniform_call():
    assert tuple(POLICY_LOSS_FNS) == POLICY_LOSSES
    lp, old, adv, mask = random_inputs(0)
    for name, fn in POLICY_LOSS_FNS.items():
        out = fn(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        assert out.loss_mat.shape == lp.shape, name
        assert set(out.metrics) == {"clipfrac_low", "clipfrac_high", "dual_clip_fraction", "ratio_mean",
                                    "ratio_min", "ratio_max", "approx_kl"}, name
        assert torch.isfinite(agg_loss(out.loss_mat, mask)), name


# --- peers' published formulas and cases ---------------------------------------------------------------------------


def verl_vanilla(old, lp, adv, mask, low, high, c):
    """volcengine/verl compute_policy_loss_vanilla, written out: (loss_mat, pg_clipfrac, pg_clipfrac_lower, ppo_kl)."""
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    clipfrac = ((l2 > l1).float() * mask).sum() / mask.sum()
    l3 = -adv * c
    clipfrac_lower = ((clip1 > l3).float() * (adv < 0).float() * mask).sum() / mask.sum()
    loss = torch.where(adv < 0, torch.minimum(l3, clip1), clip1)
    return loss, clipfrac, clipfrac_lower, (-neg_kl * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", range(4))
def test_verl_vanilla_policy_loss_and_its_metrics(seed):
    # verl's pg_clipfrac is our clipfrac_low + clipfrac_high, its pg_clipfrac_lower our dual_clip_fraction
    lp, old, adv, mask = random_inputs(seed, spread=1.5)
    loss, clipfrac, lower, kl = verl_vanilla(old, lp, adv, mask, 0.2, 0.28, 3.0)
    out = ppo_clip_token_loss(lp, old, adv, mask, 0.2, 0.28, 3.0)
    keep = mask != 0
    torch.testing.assert_close(out.loss_mat[keep], loss[keep])
    m = out.metrics
    assert (m["clipfrac_low"] + m["clipfrac_high"]).item() == pytest.approx(clipfrac.item())
    assert m["dual_clip_fraction"].item() == pytest.approx(lower.item())
    assert m["approx_kl"].item() == pytest.approx(kl.item())


def easyr1_policy_loss(old, lp, adv, mask, low, high, dual, loss_type, tau_positive=1.0, tau_negative=1.05):
    """hiyouga/EasyR1 verl/trainer/core_algos.py compute_policy_loss (token average; SAPO since EasyR1 55b40c8),
    written out: loss_mat and its pg_clipfrac_higher / pg_clipfrac_lower per-token indicators."""
    neg_kl = lp - old
    if loss_type == "gspo_token":
        seq = (neg_kl * mask).sum(-1) / mask.sum(-1)
        log_ratio = seq.detach().unsqueeze(-1) + lp - lp.detach()
    else:
        log_ratio = neg_kl
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    clipped = torch.exp(torch.clamp(log_ratio, math.log(1 - low), math.log(1 + high)))
    if loss_type == "cispo":
        return -adv * lp * clipped.detach(), None, None
    if loss_type == "sapo":
        positive, negative = (adv >= 0).float(), (adv < 0).float()
        gate_negative = 4.0 / tau_negative * torch.sigmoid(tau_negative * (ratio - 1.0))
        gate_positive = 4.0 / tau_positive * torch.sigmoid(tau_positive * (ratio - 1.0))
        return -adv * (positive * gate_positive + negative * gate_negative), None, None
    l1, l2, l3 = -adv * ratio, -adv * clipped, -adv * dual
    higher = torch.maximum(l1, l2)
    lower = torch.minimum(higher, l3)
    return torch.where(adv < 0, lower, higher), (l1 < l2).float(), (higher > l3).float() * (adv < 0).float()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("loss_type", ["default", "gspo_token", "cispo", "sapo"])
def test_easyr1_policy_loss_types(seed, loss_type):
    # EasyR1 applies dual-clip to gspo_token as well; so do we (verl's GSPO has none). EasyR1's cispo clips the
    # log ratio in [log(1 - low), log(1 + high)], the same weight as clamping the ratio.
    lp, old, adv, mask = random_inputs(seed, rows=5, width=7, spread=0.8 if loss_type != "gspo_token" else 0.05)
    mask[-1, 0] = 1.0  # EasyR1 divides by every row's token count: give each row one
    low, high = (0.2, 0.28) if loss_type != "gspo_token" else (3e-4, 4e-4)
    lp_ref, lp_ours = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ref, higher, lower = easyr1_policy_loss(old, lp_ref, adv, mask, low, high, 3.0, loss_type)
    fn = {"default": ppo_clip_token_loss, "gspo_token": gspo_token_loss, "cispo": cispo_token_loss,
          "sapo": sapo_token_loss}[loss_type]
    out = fn(lp_ours, old, adv, mask, low, high, 3.0)
    ((ref * mask).sum() / mask.sum()).backward()  # EasyR1's "token" average
    agg_loss(out.loss_mat, mask, "token-mean").backward()
    keep = mask != 0
    torch.testing.assert_close(out.loss_mat[keep], ref[keep])
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad)
    if higher is not None:
        m = out.metrics
        # EasyR1's pg_clipfrac_higher is the trust-region clip on either side, its pg_clipfrac_lower the dual-clip
        trust_region = ((higher * mask).sum() / mask.sum()).item()
        assert (m["clipfrac_low"] + m["clipfrac_high"]).item() == pytest.approx(trust_region)
        assert m["dual_clip_fraction"].item() == pytest.approx(((lower * mask).sum() / mask.sum()).item())


def verl_gspo(old, lp, adv, mask, low, high):
    """volcengine/verl compute_policy_loss_gspo, written out (no dual-clip; log ratio clamped at 10 above)."""
    neg_kl = lp - old
    seq = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    return torch.maximum(l1, l2), ((l2 > l1).float() * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", range(4))
def test_verl_gspo_with_dual_clip_off(seed):
    lp, old, adv, mask = random_inputs(seed, spread=0.05)
    lp_ref, lp_ours = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ref, clipfrac = verl_gspo(old, lp_ref, adv, mask, 3e-4, 4e-4)
    out = gspo_token_loss(lp_ours, old, adv, mask, 3e-4, 4e-4, clip_ratio_c=None)
    agg_loss(ref, mask, "seq-mean-token-mean").backward()  # verl's GSPO default aggregation
    agg_loss(out.loss_mat, mask, "seq-mean-token-mean").backward()
    keep = mask != 0
    torch.testing.assert_close(out.loss_mat[keep], ref[keep])
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad)
    assert (out.metrics["clipfrac_low"] + out.metrics["clipfrac_high"]).item() == pytest.approx(clipfrac.item())


def test_verl_cispo_cases():
    # Mirrors volcengine/verl TestComputePolicyLossCispo (test_cispo_output_format / _parameter_defaults /
    # _vs_vanilla_different_results): batch 2 x 4, randn logprobs / advantages, full mask, clip 0.2 / 0.2; the loss is
    # a finite scalar once aggregated, with our defaults too, and differs from PPO-clip's. verl's example recipe
    # (examples/cispo_trainer) sets clip_ratio_low = 10, the same weight as our default floor low = 1.0 (0).
    torch.manual_seed(0)
    old, lp, adv = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.ones(2, 4)
    cispo = agg_loss(cispo_token_loss(lp, old, adv, mask, 0.2, 0.2).loss_mat, mask)
    assert cispo.dim() == 0 and torch.isfinite(cispo)
    assert torch.isfinite(agg_loss(cispo_token_loss(lp, old, adv, mask).loss_mat, mask))
    vanilla = agg_loss(ppo_clip_token_loss(lp, old, adv, mask, 0.2, 0.2, 3.0).loss_mat, mask)
    assert torch.isfinite(vanilla) and cispo.item() != pytest.approx(vanilla.item())
    torch.testing.assert_close(cispo_token_loss(lp, old, adv, mask, 10.0, 0.2).loss_mat,
                               cispo_token_loss(lp, old, adv, mask).loss_mat)


def test_trl_clip_ratio_metrics():
    # Mirrors huggingface/trl GRPOTrainer._compute_loss's metrics: is_low_clipped = (coef_1 < 1 - epsilon_low) &
    # (A < 0), is_high_clipped = (coef_1 > 1 + epsilon_high) & (A > 0), each averaged over completion tokens.
    lp, old, adv, mask = random_inputs(11, spread=0.5)
    coef = torch.exp(lp - old)
    low_ref = (((coef < 0.8) & (adv < 0)).float() * mask).sum() / mask.sum()
    high_ref = (((coef > 1.28) & (adv > 0)).float() * mask).sum() / mask.sum()
    m = ppo_clip_token_loss(lp, old, adv, mask, 0.2, 0.28).metrics
    assert m["clipfrac_low"].item() == pytest.approx(low_ref.item())
    assert m["clipfrac_high"].item() == pytest.approx(high_ref.item())
    assert low_ref > 0 and high_ref > 0


# --- SAPO: the paper's gate, and EasyR1's, verl's and TRL's functions ----------------------------------------------


def ref_sapo(lp: float, old: float, a: float, tau_pos: float, tau_neg: float) -> tuple[float, float]:
    """(loss, d loss / d lp) of one token, written out from the paper: -A f(r), f(r) = 4/tau sigmoid(tau (r - 1))."""
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    tau = tau_pos if a > 0 else tau_neg
    s = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
    grad = -a * 4.0 * s * (1.0 - s) * r if abs(lp - old) < 20.0 else 0.0  # the clamp holds the ratio beyond 20
    return -a * 4.0 / tau * s, grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.1, 1.0), (2.0, 5.0)])
def test_sapo_matches_reference_values_and_gradients(seed, tau_pos, tau_neg):
    lp, old, adv, mask = random_inputs(seed, spread=1.2)
    lp = lp.requires_grad_(True)
    out = sapo_token_loss(lp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    agg_loss(out.loss_mat, mask, "token-mean").backward()
    tokens = int(mask.sum())
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                assert lp.grad[i, t] == 0
                continue
            loss, grad = ref_sapo(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), tau_pos, tau_neg)
            assert out.loss_mat[i, t].item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
            assert lp.grad[i, t].item() == pytest.approx(grad / tokens, rel=1e-10, abs=1e-14)
    m = out.metrics
    assert m["clipfrac_low"] == 0 and m["clipfrac_high"] == 0 and m["dual_clip_fraction"] == 0
    keep = mask != 0
    assert m["ratio_mean"].item() == pytest.approx(torch.exp(lp - old)[keep].mean().item())
    assert m["approx_kl"].item() == pytest.approx((old - lp)[keep].mean().item())


def test_sapo_on_policy_is_the_policy_gradient_and_fades_off_policy():
    # at r = 1 the gate's slope is 1 whatever tau: the gradient is -A, the plain policy gradient; away from 1 it fades
    # smoothly (never cut to 0 as PPO's clip does), faster for the larger tau
    lp = torch.tensor([[0.0, 0.0, 0.5, 0.5, -0.5, 2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    sapo_token_loss(lp, torch.zeros_like(lp), adv, torch.ones_like(lp), tau_pos=1.0, tau_neg=1.05).loss_mat.sum(
    ).backward()
    grad = lp.grad[0]
    assert grad[0].item() == pytest.approx(-1.0) and grad[1].item() == pytest.approx(2.0)
    assert all(g != 0 for g in grad.tolist())
    weight = [-g / a for g, a in zip(grad.tolist(), adv[0].tolist(), strict=True)]  # gradient weight per unit of A
    assert weight[3] < weight[2], "a negative token fades faster (tau_neg > tau_pos)"
    assert weight[5] < weight[2] < weight[0] * math.exp(0.5), "the weight falls below the unclipped ratio r"
    # PPO-clip gives the positive token at r = e^0.5 > 1.2 no gradient at all
    ppo_lp = lp.detach().clone().requires_grad_(True)
    ppo_clip_token_loss(ppo_lp, torch.zeros_like(lp), adv, torch.ones_like(lp)).loss_mat.sum().backward()
    assert ppo_lp.grad[0, 2] == 0


def verl_sapo(old, lp, adv, mask, tau_pos, tau_neg):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_policy_loss_sapo (verl-project/verl 1dda039), written
    out: (scalar loss, which verl always aggregates with seq-mean-token-mean whatever loss_agg_mode says, ppo_kl)."""
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    pg_losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv
    rows = mask.sum(-1) > 0
    seq_means = (pg_losses * mask).sum(-1)[rows] / mask.sum(-1)[rows]
    return seq_means.mean(), (-negative_approx_kl * mask).sum() / mask.sum()


def trl_sapo(old, lp, adv, mask, tau_pos, tau_neg):
    """huggingface/trl GRPOTrainer._compute_loss, loss_type="sapo", token-level importance sampling (trl f2cd577),
    written out: per_token_loss (no clamp of the log ratio) and its loss (per-sequence mean, then the mean)."""
    coef_1 = torch.exp(lp - old)
    temperatures = torch.where(adv > 0, tau_pos, tau_neg)
    per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * adv
    loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return per_token_loss, loss


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_verl_sapo_with_seq_mean_token_mean(seed, tau_pos, tau_neg):
    lp, old, adv, mask = random_inputs(seed, spread=1.5)
    adv[0, :3] = 0.0  # A = 0: verl takes tau_neg, EasyR1 tau_pos; the loss and its gradient are 0 either way
    lp_ref, lp_ours = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ref, kl = verl_sapo(old, lp_ref, adv, mask, tau_pos, tau_neg)
    ref.backward()
    out = sapo_token_loss(lp_ours, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    ours = agg_loss(out.loss_mat, mask, "seq-mean-token-mean")
    ours.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-10, atol=1e-15)
    assert out.metrics["approx_kl"].item() == pytest.approx(kl.item())


@pytest.mark.parametrize("seed", range(4))
def test_trl_sapo_with_its_sequence_mean(seed):
    # TRL's grpo/sapo loss averages each sequence's tokens, then the sequences (a row without tokens adds a 0 to
    # that mean, so give every row one)
    lp, old, adv, mask = random_inputs(seed, spread=1.0)
    mask[-1, 0] = 1.0
    lp_ref, lp_ours = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    per_token, ref = trl_sapo(old, lp_ref, adv, mask, 1.0, 1.05)
    ref.backward()
    out = sapo_token_loss(lp_ours, old, adv, mask)
    agg_loss(out.loss_mat, mask, "seq-mean-token-mean").backward()
    keep = mask != 0
    torch.testing.assert_close(out.loss_mat[keep], per_token[keep])
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad)


def test_sapo_extreme_ratios_and_padding_against_the_peers():
    # log ratios of +-60 and +100: the gate saturates at 4/tau (r -> inf) or 4/tau sigmoid(-tau) (r -> 0). Ours and
    # EasyR1's / verl's clamp the log ratio at +-20: same finite loss, no gradient. TRL does not clamp: in float32
    # exp(100) = inf and its gradient there is 0 * inf = NaN (same values elsewhere). A NaN logprob under the mask's
    # zeros (a padded position) reaches neither our loss nor our gradient; the peers multiply by the mask.
    old = torch.zeros(2, 4)
    lp = torch.tensor([[60.0, -60.0, 100.0, 0.3], [0.1, -0.2, float("nan"), float("nan")]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    lp_ours = lp.clone().requires_grad_(True)
    out = sapo_token_loss(lp_ours, old, adv, mask)
    agg_loss(out.loss_mat, mask, "token-mean").backward()
    assert torch.isfinite(out.loss_mat).all() and torch.isfinite(lp_ours.grad).all()
    clean = torch.where(mask != 0, lp, torch.zeros(()))  # what the peers see once padding is clean
    lp_easy = clean.clone().requires_grad_(True)
    easy, _, _ = easyr1_policy_loss(old, lp_easy, adv, mask, 0.2, 0.2, 3.0, "sapo")
    ((easy * mask).sum() / mask.sum()).backward()
    keep = mask != 0
    torch.testing.assert_close(out.loss_mat[keep], easy[keep])
    torch.testing.assert_close(lp_ours.grad, lp_easy.grad)
    assert out.loss_mat[0, 0].item() == pytest.approx(-4.0) and out.loss_mat[0, 2].item() == pytest.approx(-4.0)
    assert out.loss_mat[0, 1].item() == pytest.approx(4.0 / 1.05 * torch.sigmoid(torch.tensor(-1.05)).item())
    assert lp_ours.grad[0, :3].abs().max() == 0
    lp_trl = clean.clone().requires_grad_(True)
    per_token, trl = trl_sapo(old, lp_trl, adv, mask, 1.0, 1.05)
    trl.backward()
    torch.testing.assert_close(out.loss_mat[keep], per_token[keep])
    assert torch.isnan(lp_trl.grad[0, 2]) and torch.isfinite(lp_trl.grad[0, [0, 1, 3]]).all()


def test_sapo_gate_and_bad_temperatures():
    r = torch.linspace(0.0, 3.0, 31, dtype=torch.float64, requires_grad=True)
    sapo_gate(r, 1.7).sum().backward()
    assert r.grad.max().item() == pytest.approx(1.0) and r.grad.argmax().item() == 10  # the slope peaks at r = 1
    with pytest.raises(ValueError, match="tau_neg=0"):
        sapo_token_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), tau_neg=0.0)
