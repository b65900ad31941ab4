"""Routing record / replay on the embedded MoE models (`vlmrl.actor.router_hooks`, actor.moe.routing_replay): the hooks
compute exactly transformers' routing, replaying a forward's own routing changes neither logprobs nor any gradient,
a row's recorded routing replays onto the same tokens in any micro-batch layout (padded or packed, other rows
beside it), and the update reports how much of the batch its own routers would route elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.forward import forward_response, micro_batch
from vlmrl.actor.local import Actor
from vlmrl.config import ActorConfig, OptimConfig

CPU = torch.device("cpu")


def moe_actor(variant: str, **moe) -> Actor:
    from vlmrl.actor.config import MoEConfig
    from vlmrl.models.tiny import ensure_built

    config = ActorConfig(model_path=str(ensure_built(variant)), optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                         device="cpu", dtype="float32", ppo_micro_batch_size_per_gpu=3, moe=MoEConfig(**moe))
    return Actor(config, total_steps=2, mini_batch_samples=6)


@pytest.fixture(scope="module", params=["tiny-qwen3-vl-moe", "tiny-qwen3.5-moe"])
def setup(request, synthetic_rows):
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    actor = moe_actor(request.param, routing_replay="trainer")
    processor = load_processor(actor.config.model_path, DataConfig(max_prompt_length=96))
    # 3 prompts x 2 samples, prompt 1 text-only: rows with and without images, left and right padding
    batch = make_batch(processor, synthetic_rows[:3], n=2, text_only_rows=(1,), prompt_length=96)
    return actor, batch


def _forward(actor, batch, rows, packed=False, grads=False):
    actor.model.zero_grad(set_to_none=True)
    mb = micro_batch(batch, rows, CPU, packed)
    logprobs, _ = forward_response(actor.model, mb, 1.0, with_entropy=False)
    mask = batch.response_mask[rows, : mb.response_width]
    if not grads:
        return logprobs.detach() * mask
    (logprobs * mask).sum().backward()
    return logprobs.detach() * mask, {n: p.grad.clone() for n, p in actor.model.named_parameters()
                                      if p.grad is not None}


def test_recording_and_replaying_its_own_routing_change_nothing(setup):
    """Recording is transformers' routing bit for bit; replaying a forward's own routing gives the same logprobs and
    the same gradient for every parameter (routers and fused experts included) as routing freely."""
    actor, batch = setup
    rows = list(range(len(batch)))
    plain, plain_grads = _forward(actor, batch, rows, grads=True)
    actor.compute_logprobs(batch, record_routing=True)
    routes = batch.routed_experts
    hooks = actor.routing
    assert len(routes) == len(batch) and all(r.shape[0] == hooks.layers and r.shape[2] == hooks.top_k for r in routes)
    assert [r.shape[1] for r in routes] == batch.attention_mask.sum(dim=1).tolist(), "one entry per attended token"
    mb = micro_batch(batch, rows, CPU)
    with hooks.replay([routes[r] for r in rows], mb.attended()):
        replayed, replayed_grads = _forward(actor, batch, rows, grads=True)
    assert torch.equal(replayed, plain)
    assert replayed_grads.keys() == plain_grads.keys()
    assert any("experts.gate_up_proj" in n for n in plain_grads) and any(".mlp.gate." in n for n in plain_grads)
    assert all(torch.equal(replayed_grads[n], plain_grads[n]) for n in plain_grads)
    assert hooks.take_counts() == {"mismatch/routing_changed_frac": 0.0,
                                   "mismatch/routing_changed_tokens_frac": 0.0}


def test_a_rows_routing_replays_onto_its_tokens_in_any_layout(setup):
    """Routing recorded with the rows padded side by side, every id moved to another expert, replays onto the same
    tokens packed and in another row order: the same logprobs as padded (to float32 rounding), far from the
    model's own routing."""
    actor, batch = setup
    rows = list(range(len(batch)))
    actor.compute_logprobs(batch, record_routing=True)
    experts = actor.routing.num_experts
    moved = [(r.to(torch.long) + 1) % experts for r in batch.routed_experts]
    own = _forward(actor, batch, rows)
    with actor.routing.replay(moved, micro_batch(batch, rows, CPU).attended()):
        padded = _forward(actor, batch, rows)
    subset = [4, 0, 3]
    with actor.routing.replay([moved[r] for r in subset], micro_batch(batch, subset, CPU, packed=True).attended()):
        packed = _forward(actor, batch, subset, packed=True)
    width = packed.shape[1]
    assert torch.allclose(packed, padded[subset, :width], atol=1e-4, rtol=0)
    assert (padded - own).abs().max() > 0.1, "moving every expert id changed nothing: the replay is not used"
    # the first MoE layer sees the recorded hidden states, where no moved set is the router's own; later layers see
    # what the moved experts computed, and may choose anything there
    assert actor.routing.take_counts()["mismatch/routing_changed_frac"] >= 1 / actor.routing.layers
    with pytest.raises(ValueError, match="recorded tokens for a forward of"):
        with actor.routing.replay(moved[:2], micro_batch(batch, rows, CPU).attended()):
            pass


def test_the_update_reports_the_routing_its_routers_would_change(setup):
    """The update replays the old pass's routing (routing_replay=trainer): with the routers as they were, no token
    would route elsewhere (0.0); with the routers moved after the old pass, the update names the share of (token,
    MoE layer) pairs and of tokens its own routers would send to other experts."""
    actor, batch = setup
    old, _ = actor.compute_logprobs(batch, record_routing=True)
    saved = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    advantages = torch.zeros(len(batch))
    rates = [group["lr"] for group in actor.optimizer.param_groups]
    try:
        for p in actor.optimizer.param_groups:
            p["lr"] = 0.0
        metrics = actor.update(batch, old, advantages)
        assert metrics["mismatch/routing_changed_frac"] == 0.0
        assert metrics["actor/ratio_min"] == metrics["actor/ratio_max"] == 1.0
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for router in actor.routing.routers:
                router.weight.add_(torch.randn(router.weight.shape, generator=gen) * router.weight.std())
        metrics = actor.update(batch, old, advantages)
        assert 0.0 < metrics["mismatch/routing_changed_frac"] <= metrics["mismatch/routing_changed_tokens_frac"]
    finally:
        for group, rate in zip(actor.optimizer.param_groups, rates):
            group["lr"] = rate
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                p.copy_(saved[n])


def test_a_dense_model_has_no_routing_and_engine_replay_needs_the_engines_capture(tiny_model_path):
    import pytest as _pytest

    from vlmrl.actor.config import MoEConfig
    from vlmrl.config import ConfigError, load_config

    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32")
    assert Actor(config, total_steps=1, mini_batch_samples=4).routing is None
    assert MoEConfig(routing_replay="trainer").problems() == MoEConfig(routing_replay="engine").problems() == []
    assert "is not one of" in MoEConfig(routing_replay="r3").problems()[0]
    base = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
            "actor.moe.routing_replay=engine"]
    with _pytest.raises(ConfigError, match="set rollout.name=vllm and rollout.vllm.capture_routing=true"):
        load_config([*base, "rollout.name=sglang"], check_model=False)
    load_config([*base, "rollout.name=vllm", "rollout.vllm.capture_routing=true"], check_model=False)


def test_lora_on_a_moe_policy_adapts_attention_and_syncs_every_expert_merged(setup):
    """The default LoRA targets on a MoE model: attention (and Qwen3.5's linear attention and shared expert), never
    the fused experts (parameters, not Linear layers) or the routers, which stay frozen; the merged weights a sync
    sends carry every expert tensor under the model's own names, in the layout the engines convert from."""
    from vlmrl.actor.config import LoraConfig

    actor, _ = setup
    path = actor.config.model_path
    config = ActorConfig(model_path=path, device="cpu", dtype="float32", lora=LoraConfig(rank=4, alpha=8))
    lora = Actor(config, total_steps=1, mini_batch_samples=6)
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(".experts." in n or ".mlp.gate." in n for n in trainable)
    merged = dict(lora.named_tensors())
    assert merged.keys() == dict(actor.model.state_dict()).keys()
    experts = [n for n in merged if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * actor.routing.layers
    assert lora.routing is not None and lora.routing.layers == actor.routing.layers


def test_the_load_balancing_loss_is_transformers_and_only_it_moves_the_routers_of_a_zero_advantage_update(setup):
    """actor.moe.aux_loss_coef: the loss the hooks compute over a padded micro-batch's attended tokens equals
    transformers' `load_balancing_loss_func` on the same forward's router logits and attention mask; an update whose
    advantages are all 0 leaves every weight where it was, unless the loss is on: then the routers move (and
    actor/moe_aux_loss is logged)."""
    import importlib

    from vlmrl.actor.router_hooks import collect_aux

    actor, batch = setup
    rows = list(range(len(batch)))
    mb = micro_batch(batch, rows, CPU)
    module = importlib.import_module(type(actor.model).__module__)
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                  pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw, use_cache=False)
    with torch.no_grad(), collect_aux(actor.routing, mb.attended()) as aux:
        out = actor.model(**inputs, output_router_logits=True)
        ours = aux.value()
    theirs = module.load_balancing_loss_func(out.router_logits, actor.routing.num_experts, actor.routing.top_k,
                                             mb.attention_mask)
    assert torch.allclose(ours, theirs.to(ours.dtype), rtol=1e-5, atol=0)

    zero = torch.zeros(len(batch))
    saved = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    rates = [group["lr"] for group in actor.optimizer.param_groups]
    for group in actor.optimizer.param_groups:
        group["lr"] = 1e-2
    try:
        metrics = actor.update(batch, None, zero)
        assert all(torch.equal(p, saved[n]) for n, p in actor.model.named_parameters())
        assert "actor/moe_aux_loss" not in metrics
        actor.config.moe.aux_loss_coef = 0.01
        metrics = actor.update(batch, None, zero)
        moved = {n for n, p in actor.model.named_parameters() if not torch.equal(p, saved[n])}
        routers = {n for n, _ in actor.model.named_parameters() if n.endswith(".mlp.gate.weight")}
        assert routers <= moved and metrics["actor/moe_aux_loss"] > 0
    finally:
        actor.config.moe.aux_loss_coef = 0.0
        for group, rate in zip(actor.optimizer.param_groups, rates):
            group["lr"] = rate
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                p.copy_(saved[n])


def test_the_drill_down_names_the_moe_layer_whose_routing_differs(synthetic_rows):
    """compare's --drill-down on a MoE model records both sides' routers: against a reference whose layer-1 router
    moved, it names layer 1 as the first module and the first MoE layer whose routing differs (layer 0 routes every
    token the same); against the same weights, every module and every token's experts agree."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.alignment.drill_down import FLOAT32_TOLERANCE, drill_down
    from vlmrl.alignment.report import drill_down_line
    from vlmrl.data.config import DataConfig
    from vlmrl.models.families import QWEN3_VL_MOE
    from vlmrl.processors.loading import load_processor

    actor = moe_actor("tiny-qwen3-vl-moe")
    batch = make_batch(load_processor(actor.config.model_path, DataConfig(max_prompt_length=96)), synthetic_rows[:1],
                       n=1, prompt_length=96, response_length=12)
    reference = AutoModelForImageTextToText.from_pretrained(actor.config.model_path, dtype=torch.float32).eval()

    def drill():
        return drill_down(actor, reference, batch, 0, family=QWEN3_VL_MOE, index=0, sample_index=0,
                          tolerance=FLOAT32_TOLERANCE)

    same = drill()
    assert same.first is None and same.routing["first_layer"] is None and same.routing["differing_pairs"] == 0
    assert "routing: the same experts at every token" in drill_down_line(same.to_dict())
    router = reference.model.language_model.layers[1].mlp.gate.weight
    with torch.no_grad():
        router.mul_(-1.0)  # every token's top-k of layer 1 becomes its bottom-k
    moved = drill()
    assert moved.first == "model.language_model.layers.1", moved.first
    assert moved.routing["first_layer"] == 1 and moved.routing["differing_pairs"] > 0, moved.routing
    line = drill_down_line(moved.to_dict())
    assert "starts at model.language_model.layers.1" in line and "routing first differs at MoE layer 1" in line
