"""LoRA on the tiny Qwen2.5-VL (actor.lora, PEFT): which layers get adapters, that only they train and hold optimizer
state, that the KL reference is the base model itself (no copy loaded) and equal to it exactly, that the merged
weights are PEFT's merge in bfloat16 and stream a layer at a time, and that an adapter folder round-trips (resume) and
loads in PEFT; each family's adapted layers. That every family's merged weights are PEFT's merge in float32 and give
the unmerged model's logprobs is the family matrix's (tests/families/test_family_matrix.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.local import Actor
from vlmrl.actor.lora import (
    ADAPTER_DIR,
    adapter_tensors,
    apply_lora,
    load_adapter_weights,
    merged_names,
    merged_tensors,
    target_modules,
)
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.config import ActorConfig, LoraConfig, OptimConfig, load_config


def lora_actor(model_path: str, kl: bool = True, **lora) -> Actor:
    config = ActorConfig(model_path=model_path, optim=OptimConfig(lr=1e-2, weight_decay=0.0), device="cpu",
                         ppo_micro_batch_size_per_gpu=8, use_kl_loss=kl, kl_loss_coef=0.1 if kl else 0.0,
                         lora=LoraConfig(rank=4, alpha=8, **lora))
    return Actor(config, total_steps=2, mini_batch_samples=8)


@pytest.fixture(scope="module")
def batch(processor, synthetic_rows):
    # 4 prompts x 2 samples; prompt 2 text-only
    return make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,))


def _step(actor: Actor, batch) -> dict[str, float]:
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    ref, _ = actor.compute_logprobs(batch, reference=True)
    return actor.update(batch, None, advantages, ref)


def _base_model(model_path: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)


def test_adapters_go_where_lora_vision_says(tiny_model_path):
    model = _base_model(tiny_model_path)
    default = target_modules(model, LoraConfig(rank=4))
    assert default and all(n.startswith("model.language_model.layers.") for n in default)
    assert {n.rsplit(".", 1)[1] for n in default} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"}
    # the vision tower's MLP has gate/up/down projections too: exclude_modules keeps them out by default
    tower = set(target_modules(model, LoraConfig(rank=4, vision="tower"))) - set(default)
    assert tower and all(n.startswith("model.visual.blocks.") for n in tower)
    assert {n.split(".", 4)[4] for n in tower} == {"attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj",
                                                   "mlp.down_proj"}
    merger = set(target_modules(model, LoraConfig(rank=4, vision="merger"))) - set(default)
    assert merger == {"model.visual.merger.mlp.0", "model.visual.merger.mlp.2"}
    both = set(target_modules(model, LoraConfig(rank=4, vision="tower+merger")))
    assert both == set(default) | tower | merger
    only_q = target_modules(model, LoraConfig(rank=4, target_modules=["q_proj"], exclude_modules=r".*layers\.0\..*"))
    assert only_q == ["model.language_model.layers.1.self_attn.q_proj"]
    with pytest.raises(ValueError, match="selects no Linear layer"):
        target_modules(model, LoraConfig(rank=4, target_modules=["nothing"]))


def test_lora_vision_off_adapts_no_vision_layer_whatever_exclude_modules_says(tiny_model_path):
    # Qwen2.5-VL's vision MLP is named gate_proj/up_proj/down_proj like the language model's: an exclude_modules
    # narrower than the default must not let the suffix rule reach it, since the engine serves no vision adapter
    model = _base_model(tiny_model_path)
    names = target_modules(model, LoraConfig(rank=4, exclude_modules=r".*language_model\.layers\.0\..*"))
    vision = [n for n in names if n.startswith("model.visual.")]
    assert not vision, f"vision=off adapted {len(vision)} vision layers, e.g. {vision[:2]}"
    assert len(names) == 7 and all(n.startswith("model.language_model.layers.1.") for n in names), names
    # lora.vision still decides the vision side alone: tower adds the tower blocks, and never the merger
    tower = target_modules(model, LoraConfig(rank=4, exclude_modules="", vision="tower"))
    assert {n for n in tower if n.startswith("model.visual.")} == {
        n for n, m in model.named_modules() if n.startswith("model.visual.blocks.") and isinstance(m, torch.nn.Linear)}


def test_the_start_up_log_counts_the_adapted_layers(tiny_model_path, caplog):
    from peft.tuners.lora import LoraLayer

    with caplog.at_level(logging.INFO, logger="vlmrl.actor.lora"):
        model = apply_lora(_base_model(tiny_model_path), LoraConfig(rank=4, vision="tower+merger"))
    layers = sum(isinstance(m, LoraLayer) for m in model.modules())
    assert layers == 14 + 10 + 2  # language projections, tower blocks, merger
    assert f"on {layers} layers (12 of the vision side;" in caplog.text, caplog.text


def test_config_checks_name_what_to_change():
    run = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic", "rollout.name=hf"]
    with pytest.raises(ValueError, match="actor.lora.vision='all'"):
        load_config([*run, "actor.lora.rank=8", "actor.lora.vision=all"])
    with pytest.raises(ValueError, match="actor.lora.sync=adapter needs a backend"):
        load_config([*run, "actor.lora.rank=8", "actor.lora.sync=adapter"])
    config = load_config([*run, "actor.lora.rank=64", "actor.lora.vision=tower+merger"])
    assert config.actor.lora.enabled and config.actor.lora.alpha == 16.0


def test_only_adapters_train_and_hold_optimizer_state(tiny_model_path, batch):
    actor = lora_actor(tiny_model_path, vision="tower+merger")
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = _step(actor, batch)
    assert metrics["actor/grad_norm"] > 0
    adapters = {n for n, p in actor.model.named_parameters() if ".lora_" in n}
    trained = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trained == adapters and any(".visual." in n for n in adapters)
    assert [id(p) for p in actor.trainable] == [id(p) for n, p in actor.model.named_parameters() if n in adapters]
    # AdamW moments exist for the adapters and nothing else
    state = actor.optimizer.state
    assert len(state) == len(adapters)
    assert all(".lora_" in n for n, p in actor.model.named_parameters() if p in state)
    changed = {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= adapters, f"base weights moved: {sorted(changed - adapters)[:3]}"


def test_reference_is_the_base_model_exactly_and_no_copy_is_loaded(tiny_model_path, batch):
    actor = lora_actor(tiny_model_path)
    base = Actor(ActorConfig(model_path=tiny_model_path, device="cpu", ppo_micro_batch_size_per_gpu=8),
                 total_steps=1, mini_batch_samples=8)
    base_params = sum(p.numel() for p in base.model.parameters())
    adapters = sum(p.numel() for p in actor.trainable)
    # everything the LoRA actor holds: one base model and the adapters; the KL loss loaded no reference copy
    assert actor.reference is None
    assert sum(p.numel() for p in actor.model.parameters()) == base_params + adapters
    assert adapters < base_params / 10
    for _ in range(2):
        _step(actor, batch)
    policy, _ = actor.compute_logprobs(batch)
    reference, _ = actor.compute_logprobs(batch, reference=True)
    expected, _ = base.compute_logprobs(batch)
    assert torch.equal(reference, expected), "the adapters-off reference differs from the base model"
    assert (policy - reference).abs().max() > 1e-3, "the adapters did not move the policy: nothing was compared"
    # the context restored the adapters: the policy is the trained one again
    again, _ = actor.compute_logprobs(batch)
    assert torch.equal(again, policy)


def test_merged_bfloat16_weights_equal_peft_merge_and_unload(tiny_model_path):
    """PEFT multiplies a 16-bit adapter on CPU in float32 and casts back: vlmrl's merge does too, so the merged
    bfloat16 weights are PEFT's exactly; the changed-only stream is exactly the adapted layers' weights."""
    from peft import get_peft_model

    from vlmrl.actor.lora import lora_scaling, peft_config

    lora = LoraConfig(rank=4, alpha=8, vision="tower+merger")
    dtype = torch.bfloat16
    model = get_peft_model(_base_model(tiny_model_path).to(dtype), peft_config(_base_model(tiny_model_path), lora))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    ours = dict(merged_tensors(model.state_dict().items(), lora_scaling(lora)))
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), [k for k in theirs if not torch.equal(ours[k],
                                                                                                      theirs[k])][:3]
    changed = dict(merged_tensors(model.state_dict().items(), lora_scaling(lora), changed_only=True))
    adapted = {f"{n}.weight" for n in peft_config(_base_model(tiny_model_path), lora).target_modules}
    assert set(changed) == adapted
    base = _base_model(tiny_model_path).to(dtype).state_dict()
    assert all(not torch.equal(changed[k], base[k]) for k in changed)


def test_merged_weights_stream_one_layer_at_a_time_under_the_names_announced(tiny_model_path):
    """A bucketed sync (rollout.sync_bucket_mb) is told the names first and then reads the merged weights as a
    stream: `merged_names` must be the stream's names in its order, and the stream must not read ahead of the layer
    it is merging (else host memory holds the model, not a bucket)."""
    from peft import get_peft_model

    from vlmrl.actor.lora import peft_config

    lora = LoraConfig(rank=4, alpha=8, vision="tower+merger", target_modules=["q_proj", "down_proj", "lm_head"])
    model = get_peft_model(_base_model(tiny_model_path), peft_config(_base_model(tiny_model_path), lora))
    state = model.state_dict()
    position = {name.removeprefix("base_model.model."): i for i, name in enumerate(state)}

    def last_part(name: str) -> int:
        """Index of the last input the merged weight `name` needs (a LoRA layer's: its base, A or B)."""
        module, leaf = name.rsplit(".", 1)
        parts = [f"{module}.base_layer.weight", f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"]
        if leaf == "weight" and parts[1] in position:
            return max(position[p] for p in parts)
        return position.get(f"{module}.base_layer.bias" if leaf == "bias" else name, position.get(name))

    for changed_only in (False, True):
        read = 0

        def counting():
            nonlocal read
            for item in state.items():
                read += 1
                yield item

        seen = []
        for name, _ in merged_tensors(counting(), 2.0, changed_only=changed_only):
            seen.append(name)
            assert read == last_part(name) + 1, f"{name}: the merge read {read - last_part(name) - 1} tensors ahead"
        assert seen == merged_names(state, changed_only=changed_only)
    assert len(merged_names(state, changed_only=True)) == len(peft_config(_base_model(tiny_model_path),
                                                                          lora).target_modules)


def test_adapter_folder_round_trips_and_loads_in_peft(tiny_model_path, batch, tmp_path):
    from peft import PeftModel

    actor = lora_actor(tiny_model_path, vision="tower")
    _step(actor, batch)
    actor.save_adapter(tmp_path)
    folder = tmp_path / ADAPTER_DIR
    assert {p.name for p in folder.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    # PEFT's own loader gives the trained policy
    peft = PeftModel.from_pretrained(_base_model(tiny_model_path), str(folder)).eval()
    ours = adapter_tensors(actor.model.state_dict().items())
    theirs = adapter_tensors(peft.state_dict().items())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # a fresh actor restored from the folder (what resume does) computes exactly the trained policy
    fresh = lora_actor(tiny_model_path, vision="tower")
    load_adapter_weights(fresh.model, folder)
    assert torch.equal(fresh.compute_logprobs(batch)[0], actor.compute_logprobs(batch)[0])
    # a full model's checkpoint (no adapter folder) is refused, saying what to do
    with pytest.raises(ValueError, match="written without LoRA"):
        load_adapter_weights(fresh.model, tmp_path / "nothing")
    # the merged model a checkpoint saves computes the policy too
    merged = actor.full_model()
    assert type(merged).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    merged_actor = Actor(ActorConfig(model_path=tiny_model_path, device="cpu", ppo_micro_batch_size_per_gpu=8),
                         total_steps=1, mini_batch_samples=8)
    merged_actor.model.load_state_dict(merged.state_dict())
    assert torch.allclose(merged_actor.compute_logprobs(batch)[0], actor.compute_logprobs(batch)[0], atol=1e-5)


def test_the_lora_recipe_overlay_loads_on_the_geo3k_recipe():
    from pathlib import Path

    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    config = load_config([f"config={configs / 'qwen2_5_vl_geo3k.yaml'}",
                          f"config={configs / 'qwen2_5_vl_geo3k_lora.yaml'}"], check_model=False)
    lora = config.actor.lora
    assert (lora.rank, lora.alpha, config.actor.optim.lr) == (64, 64.0, 1e-5)  # EasyR1's published LoRA settings
    assert lora.vision == "off" and lora.exclude_modules == r"model\.visual\..*" and config.actor.use_kl_loss
    assert config.data.max_response_length == 2048  # the overlay keeps the geo3k recipe's lengths


# ---- Qwen3.5: the linear-attention projections are adapted by default ------------------------------------------


def test_qwen3_5_default_targets_take_the_linear_attention_projections(tiny_qwen3_5_path):
    """The default target list adapts every projection of Qwen3.5's language layers: the full-attention layer's
    q/k/v/o, each layer's MLP, and both Gated DeltaNet layers' in_proj_qkv/z/b/a and out_proj; an explicit list is
    taken as written (no linear-attention projection unless named)."""
    model = _base_model(tiny_qwen3_5_path)
    names = target_modules(model, LoraConfig(rank=4))
    for layer in (0, 1):
        for projection in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            assert f"model.language_model.layers.{layer}.linear_attn.{projection}" in names
    assert "model.language_model.layers.2.self_attn.q_proj" in names
    assert not any(n.startswith("model.visual.") for n in names)
    explicit = target_modules(model, LoraConfig(rank=4, target_modules=["q_proj", "gate_proj"]))
    assert not any(".linear_attn." in n for n in explicit) and explicit


def test_qwen3_5_a_step_trains_the_linear_attention_adapters(tiny_qwen3_5_path, synthetic_rows):
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    processor = load_processor(tiny_qwen3_5_path, DataConfig(max_prompt_length=64))
    data = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,))
    actor = lora_actor(tiny_qwen3_5_path)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    _step(actor, data)
    moved = {n for n, p in actor.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert any(".linear_attn.in_proj_qkv.lora_" in n for n in moved), sorted(moved)[:5]
    assert any(".linear_attn.out_proj.lora_" in n for n in moved)


def test_glm4v_lora_adapts_its_fused_mlp_and_its_tower(synthetic_rows):
    """GLM-4.1V's language MLP is one fused gate_up_proj: the default targets take it beside q/k/v/o and down_proj,
    and lora.vision=tower+merger adds its vision blocks and its projector (never the `downsample` convolution); a
    step trains the language and vision adapters."""

    from vlmrl.data.config import DataConfig
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    path = str(ensure_built("tiny-glm4v"))
    model = _base_model(path)
    lora = LoraConfig(rank=4, alpha=8, vision="tower+merger")
    names = target_modules(model, lora)
    language = {n.rsplit(".", 1)[1] for n in names if n.startswith("model.language_model.")}
    assert language == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert {n for n in names if n.startswith("model.visual.merger.")} == {
        f"model.visual.merger.{p}" for p in ("proj", "gate_proj", "up_proj", "down_proj")}
    assert "model.visual.blocks.0.attn.qkv" in names and not any("downsample" in n for n in names)

    data = make_batch(load_processor(path, DataConfig(max_prompt_length=64)), synthetic_rows[:4], n=2,
                      text_only_rows=(2,))
    actor = lora_actor(path, vision="tower+merger")
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    _step(actor, data)
    moved = {n for n, p in actor.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert any(".mlp.gate_up_proj.lora_" in n for n in moved), sorted(moved)[:5]
    assert any(".visual.blocks." in n for n in moved) and any(".visual.merger." in n for n in moved)


def test_internvl_lora_adapts_its_tower_blocks_and_the_projector():
    """InternVL's projector sits outside its tower: lora.vision=merger adapts the projector's linears, tower its
    InternViT blocks (encoder.layer.N), and neither side is taken by the language suffix rule."""

    from vlmrl.models.tiny import ensure_built

    path = str(ensure_built("tiny-internvl"))
    model = _base_model(path)
    merger = set(target_modules(model, LoraConfig(rank=4, alpha=8, vision="merger")))
    assert {n for n in merger if not n.startswith("model.language_model.")} == {
        "model.multi_modal_projector.linear_1", "model.multi_modal_projector.linear_2"}
    tower = set(target_modules(model, LoraConfig(rank=4, alpha=8, vision="tower")))
    assert {n for n in tower if not n.startswith("model.language_model.")} == {
        f"model.vision_tower.encoder.layer.{i}.{p}" for i in range(2)
        for p in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.projection_layer",
                  "mlp.fc1", "mlp.fc2")}
    assert not any("vision_tower" in n or "projector" in n
                   for n in target_modules(model, LoraConfig(rank=4, alpha=8, vision="off")))
