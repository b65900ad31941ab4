"""Token-budget micro-batches and the packed (padding-free) forward: the plans keep their budget, and every new path
gives the logprobs, losses, gradients and updated weights of the fixed-row padded one, on plain, agent (tool tokens
masked out of the loss) and padding-row batches. That every family's packed logprobs are its padded ones is the family
matrix's (tests/families/test_family_matrix.py); the updates through packs of the families with their own trained
parts (Qwen3-VL's deepstack mergers, Qwen3.5's linear attention, GLM-4.1V's projector) are here."""

from __future__ import annotations

import dataclasses
import doctest
import logging
import random

import pytest
import torch

from tests.actor.test_actor import actor_config
from tests.batches import make_batch
from vlmrl.actor.forward import micro_batch
from vlmrl.actor.local import Actor
from vlmrl.actor.micro_batches import cost, plan_micro_batches, row_spans, split_to_count
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.batch.padding import upsample_to_multiple
from vlmrl.utils.partition import fewest_bins_under, karmarkar_karp

# ---- partitions (cases after verl's tests/utils/test_seqlen_balancing.py) ------------------------------------------


@pytest.mark.parametrize("module", ["vlmrl.utils.partition", "vlmrl.actor.micro_batches", "vlmrl.rollout.base",
                                    "vlmrl.distributed.sharding"])
def test_doctests(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def _random_lengths(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 90) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_karmarkar_karp_places_every_row_exactly_once(seed):
    lengths = _random_lengths(seed)
    for k in (1, 2, 3, 7):
        sets = karmarkar_karp(lengths, k)
        assert len(sets) == k
        assert sorted(i for s in sets for i in s) == list(range(len(lengths)))


@pytest.mark.parametrize("seed", range(5))
def test_equal_size_sets_have_equal_counts_and_near_equal_sums(seed):
    lengths = _random_lengths(seed)
    sets = karmarkar_karp(lengths, 4, equal_size=True)
    assert [len(s) for s in sets] == [5, 5, 5, 5]
    sums = [sum(lengths[i] for i in s) for s in sets]
    assert max(sums) - min(sums) <= max(lengths) - min(lengths)  # far below a contiguous split's spread
    contiguous = [sum(lengths[i:i + 5]) for i in range(0, 20, 5)]
    assert max(sums) - min(sums) <= max(contiguous) - min(contiguous)


def test_equal_size_refuses_counts_that_do_not_divide():
    with pytest.raises(ValueError, match="do not split into 3"):
        karmarkar_karp([1, 2, 3, 4], 3, equal_size=True)


@pytest.mark.parametrize("seed", range(5))
def test_fewest_bins_keep_the_budget_with_the_count_verl_starts_from(seed):
    lengths = _random_lengths(seed)
    bins = fewest_bins_under(lengths, budget=300)
    assert all(sum(lengths[i] for i in b) <= 300 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(20))
    assert len(bins) >= -(-sum(lengths) // 300)  # verl's count: ceil(total / budget), the lower bound
    assert len(fewest_bins_under(lengths, budget=300, min_bins=12)) == 12  # verl's min_num_micro_batch


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("seed", range(5))
def test_plans_never_exceed_the_budget_but_for_a_lone_overlong_row(seed, packed, caplog):
    rng = random.Random(seed)
    spans = [(rng.randint(5, 40), rng.randint(1, 60)) for _ in range(24)] + [(50, 200)]  # the last one is overlong
    with caplog.at_level(logging.WARNING):
        plan = plan_micro_batches(spans, budget=180, packed=packed)
    assert sorted(i for mb in plan for i in mb) == list(range(25))
    for mb in plan:
        assert cost([spans[i] for i in mb], packed) <= 180 or mb == [24], mb
    assert [24] in plan and "over actor.micro_batch_tokens=180" in caplog.text
    more = split_to_count(plan, spans, len(plan) + 3, packed)  # a sharded rank matching a rank with more packs
    assert len(more) == len(plan) + 3 and all(cost([spans[i] for i in mb], packed) <= 180 or mb == [24] for mb in more)


def test_packing_processes_fewer_tokens_than_fixed_rows():
    rng = random.Random(0)
    spans = [(rng.randint(300, 1100), min(2048, int(rng.paretovariate(1.2) * 50))) for _ in range(64)]
    fixed = sum(cost(spans[i:i + 4], packed=False) for i in range(0, 64, 4))
    budget = 4 * 3200
    padded = sum(cost([spans[i] for i in mb], False) for mb in plan_micro_batches(spans, budget, packed=False))
    packed = sum(cost([spans[i] for i in mb], True) for mb in plan_micro_batches(spans, budget, packed=True))
    assert packed == sum(p + r for p, r in spans) < padded < fixed


# ---- the forward and the update on the tiny model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def batch(processor, synthetic_rows):
    return make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,), response_length=8)


@pytest.fixture(scope="module")
def agent_batch(batch):
    """The batch with 'tool tokens' inside the responses: attended, but out of the loss (response_mask 0)."""
    masked = batch.response_mask.clone()
    masked[:, 1:3] = 0
    return dataclasses.replace(batch, response_mask=masked)


@pytest.fixture(scope="module")
def padded_batch(processor, batch):
    return upsample_to_multiple(batch, 12, eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)


@pytest.mark.parametrize("budget, packed", [(200, False), (200, True), (1, True)],
                         ids=["budget-padded", "budget-packed", "every-row-overlong"])
def test_logprobs_and_entropy_equal_the_fixed_row_padded_pass(tiny_model_path, batch, budget, packed):
    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=3), total_steps=1, mini_batch_samples=8)
    expected, expected_entropy = actor.compute_logprobs(batch, with_entropy=True)
    actor.config.micro_batch_tokens, actor.config.padding_free = budget, packed
    got, entropy = actor.compute_logprobs(batch, with_entropy=True)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)


def _update(tiny_model_path, batch, **overrides):
    actor = Actor(actor_config(tiny_model_path, **overrides), total_steps=1, mini_batch_samples=len(batch) // 2)
    actor.model.to(torch.float64)  # so that only the summation order could differ
    old, _ = actor.compute_logprobs(batch)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    metrics = actor.update(batch, old.to(torch.float64), advantages.to(torch.float64))
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    return actor, metrics, grads


@pytest.mark.parametrize("kind", ["plain", "agent", "padding-rows"])
@pytest.mark.parametrize("overrides", [dict(micro_batch_tokens=150), dict(micro_batch_tokens=150, padding_free=True),
                                       dict(padding_free=True)], ids=["budget", "budget-packed", "packed"])
def test_update_equals_the_fixed_row_update(tiny_model_path, batch, agent_batch, padded_batch, kind, overrides):
    data = {"plain": batch, "agent": agent_batch, "padding-rows": padded_batch}[kind]
    base, base_metrics, base_grads = _update(tiny_model_path, data, ppo_micro_batch_size_per_gpu=2)
    new, metrics, grads = _update(tiny_model_path, data, ppo_micro_batch_size_per_gpu=2, **overrides)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-7, abs=1e-10), key
    assert base_metrics["actor/grad_norm"] > 0
    assert grads.keys() == base_grads.keys()
    for name, grad in base_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-6, atol=1e-10), name
    for (name, p), (_, q) in zip(base.model.named_parameters(), new.model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-7, atol=1e-10), name


def test_the_budget_bounds_every_forward(tiny_model_path, batch):
    actor = Actor(actor_config(tiny_model_path, micro_batch_tokens=150, padding_free=False), total_steps=1,
                  mini_batch_samples=8)
    spans = row_spans(batch)
    plan = actor.micro_batches(batch, range(len(batch)))
    assert len(plan) > 1
    for rows in plan:
        mb = micro_batch(batch, rows, actor.device)
        assert mb.input_ids.numel() == cost([spans[i] for i in rows], packed=False) <= 150 or len(rows) == 1
        packed = micro_batch(batch, rows, actor.device, packed=True)
        assert packed.input_ids.numel() == cost([spans[i] for i in rows], packed=True)


# ---- the packed forward on Qwen3-VL (interleaved mrope, deepstack) -----------------------------------------------


def family_batches(model_path: str, synthetic_rows) -> dict:
    """Like `batch` and `padded_batch`, built with that model's processor (its own image grids)."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    processor = load_processor(model_path, DataConfig(max_prompt_length=64))
    plain = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,), response_length=8)
    padded = upsample_to_multiple(plain, 12, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    return {"plain": plain, "padding-rows": padded}


@pytest.fixture(scope="module")
def qwen3_batches(tiny_qwen3_vl_path, synthetic_rows):
    """`family_batches` of the embedded Qwen3-VL (its own 32-px image grids)."""
    return family_batches(tiny_qwen3_vl_path, synthetic_rows)


@pytest.mark.parametrize("kind", ["plain", "padding-rows"])
@pytest.mark.parametrize("overrides", [dict(padding_free=True), dict(micro_batch_tokens=150, padding_free=True)],
                         ids=["packed", "budget-packed"])
def test_qwen3_vl_packed_update_equals_the_padded_update(tiny_qwen3_vl_path, qwen3_batches, kind, overrides):
    data = qwen3_batches[kind]
    base, base_metrics, base_grads = _update(tiny_qwen3_vl_path, data, ppo_micro_batch_size_per_gpu=2)
    new, metrics, grads = _update(tiny_qwen3_vl_path, data, ppo_micro_batch_size_per_gpu=2, **overrides)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-7, abs=1e-10), key
    assert base_metrics["actor/grad_norm"] > 0
    assert grads.keys() == base_grads.keys()
    assert any("deepstack" in name for name in grads)  # the deepstack mergers are trained through the pack too
    for name, grad in base_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-6, atol=1e-10), name
    for (name, p), (_, q) in zip(base.model.named_parameters(), new.model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-7, atol=1e-10), name


# ---- the packed forward on Qwen3.5 (Gated DeltaNet layers keep rows apart through vlmrl.actor.packing) -----------


@pytest.fixture(scope="module")
def qwen3_5_batches(tiny_qwen3_5_path, synthetic_rows):
    """`family_batches` of the embedded Qwen3.5."""
    return family_batches(tiny_qwen3_5_path, synthetic_rows)


@pytest.mark.parametrize("kind", ["plain", "padding-rows"])
def test_qwen3_5_packed_logprobs_equal_each_row_alone(tiny_qwen3_5_path, qwen3_5_batches, kind):
    """A packed micro-batch gives each row's logprobs as the padded pass (rows alone in their own sequence) does:
    the linear-attention layers' convolution and recurrent state restart at every row. Without the row boundaries
    (the layers as transformers ships them) the rows after the first read the state the previous row left."""
    from vlmrl.actor.forward import forward_response
    from vlmrl.actor.packing import add_row_boundaries

    data = qwen3_5_batches[kind]
    actor = Actor(actor_config(tiny_qwen3_5_path, ppo_micro_batch_size_per_gpu=3), total_steps=1,
                  mini_batch_samples=8)
    assert add_row_boundaries(actor.model) == 2  # [GDN, GDN, full]: already given, counted again
    expected, _ = actor.compute_logprobs(data)
    actor.config.ppo_micro_batch_size_per_gpu = 1  # each row alone in its forward
    alone, _ = actor.compute_logprobs(data)
    assert torch.allclose(alone, expected, atol=1e-5), (alone - expected).abs().max()

    rows = [0, 4, 6]  # an image row, a text-only row, an image row
    mb = micro_batch(data, rows, actor.device, packed=True)
    mixers = [m for m in actor.model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert len(mixers) == 2
    with torch.no_grad():
        good, _ = forward_response(actor.model.eval(), mb, 1.0, False)
        for mixer in mixers:  # the shipped class: one sequence across the pack
            mixer.__class__ = type(mixer).__mro__[2]
        leaky, _ = forward_response(actor.model, mb, 1.0, False)
    mask = data.response_mask[rows, :mb.response_width]
    assert torch.allclose(good * mask, expected[rows, :mb.response_width], atol=1e-5)
    assert not torch.allclose(leaky[1:] * mask[1:], expected[rows[1:], :mb.response_width], atol=1e-3)


@pytest.mark.parametrize("kind", ["plain", "padding-rows"])
def test_qwen3_5_packed_update_equals_the_padded_update(tiny_qwen3_5_path, qwen3_5_batches, kind):
    """The update through packed micro-batches: the padded update's losses, gradients (the linear-attention
    projections among them) and weights."""
    data = qwen3_5_batches[kind]
    base, base_metrics, base_grads = _update(tiny_qwen3_5_path, data, ppo_micro_batch_size_per_gpu=2)
    new, metrics, grads = _update(tiny_qwen3_5_path, data, ppo_micro_batch_size_per_gpu=2, padding_free=True)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-7, abs=1e-10), key
    assert base_metrics["actor/grad_norm"] > 0
    assert grads.keys() == base_grads.keys()
    assert any(".linear_attn.in_proj_qkv" in name for name in grads)
    # transformers' Gated DeltaNet computes its delta rule and gated norm in float32 whatever the model's dtype, so
    # a float64 model agrees to float32 rounding of each tensor's scale (measured: 1.8e-7 of it at most), not 1e-15
    for name, grad in base_grads.items():
        scale = grad.abs().max().item()
        assert (grads[name] - grad).abs().max().item() <= 1e-6 * scale + 1e-12, name
    for (name, p), (_, q) in zip(base.model.named_parameters(), new.model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-9), name


# ---- the packed forward on GLM-4.1V (3D mrope over a partial rotary, learned vision position embeddings) ----------


@pytest.fixture(scope="module")
def glm4v_batches(synthetic_rows):
    """`family_batches` of the embedded GLM-4.1V."""
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-glm4v")), family_batches(str(ensure_built("tiny-glm4v")), synthetic_rows)


def test_glm4v_packed_update_equals_the_padded_update(glm4v_batches):
    path, batches = glm4v_batches
    data = batches["padding-rows"]
    base, base_metrics, base_grads = _update(path, data, ppo_micro_batch_size_per_gpu=2)
    new, metrics, grads = _update(path, data, ppo_micro_batch_size_per_gpu=2, micro_batch_tokens=150,
                                  padding_free=True)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-7, abs=1e-10), key
    assert base_metrics["actor/grad_norm"] > 0 and grads.keys() == base_grads.keys()
    assert any("visual.merger" in name for name in grads)  # the projector is trained through the pack too
    for name, grad in base_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-6, atol=1e-10), name
