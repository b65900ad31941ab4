"""LoRA on a Mixture-of-Experts policy's routed experts (actor.lora.experts, PEFT `target_parameters`) on the embedded
MoE models: every MoE layer's fused gate_up_proj / down_proj carries an adapter and a step trains exactly the
adapters, the merged stream comes under transformers' fused names and shapes (one layer's parts held at a time; that
it is PEFT's `merge_and_unload()` bit for bit, and gives the unmerged model's logprobs, is the family matrix's:
tests/families/test_family_matrix.py), and the adapter folder round-trips through a resume exactly. The merged sync into
vLLM is tested beside its engine (tests/rollout/qwen3_vl_moe/test_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.local import Actor
from vlmrl.actor.lora import (
    ADAPTER_DIR,
    EXPERT_PARAMETERS,
    adapted_modules,
    adapter_tensors,
    apply_lora,
    lora_scaling,
    merged_names,
    merged_tensors,
    peft_config,
)
from vlmrl.config import ActorConfig, LoraConfig, OptimConfig, load_config

MOE_VARIANTS = ("tiny-qwen3-vl-moe", "tiny-qwen3.5-moe")


def _base_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)


def expert_lora_actor(model_path: str, init_path=None) -> Actor:
    config = ActorConfig(model_path=model_path, optim=OptimConfig(lr=1e-2, weight_decay=0.0), device="cpu",
                         dtype="float32", ppo_micro_batch_size_per_gpu=3,
                         lora=LoraConfig(rank=4, alpha=8, experts=True))
    return Actor(config, total_steps=2, mini_batch_samples=3, init_path=init_path)


@pytest.fixture(scope="session")
def qwen3_vl_moe_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-qwen3-vl-moe"))


@pytest.fixture(scope="module")
def trained(qwen3_vl_moe_path, synthetic_rows):
    """A Qwen3-VL-MoE actor with expert adapters after one GRPO update of two optimizer steps (the first moves only
    lora_B, which starts at 0; the second lora_A too), its weights before the update, and the batch."""
    from vlmrl.algorithms.grpo import group_advantages
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    actor = expert_lora_actor(qwen3_vl_moe_path)
    processor = load_processor(qwen3_vl_moe_path, DataConfig(max_prompt_length=96))
    # 3 prompts x 2 samples, prompt 1 text-only
    batch = make_batch(processor, synthetic_rows[:3], n=2, text_only_rows=(1,), prompt_length=96)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    old = actor.compute_logprobs(batch)[0]
    metrics = actor.update(batch, old, group_advantages(batch.rewards, batch.uids, batch.is_padding))
    assert metrics["actor/grad_norm"] > 0
    return actor, before, batch


def test_every_moe_layers_experts_get_adapters_and_a_step_trains_only_adapters(trained):
    actor, before, _ = trained
    text = actor.model.get_base_model().config.text_config
    moe_layers = range(text.num_hidden_layers)  # the tiny MoE models route every layer through experts
    experts = {f"model.language_model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in EXPERT_PARAMETERS}
    assert experts <= set(adapted_modules(actor.model)), sorted(experts - set(adapted_modules(actor.model)))
    # per MoE layer four adapter tensors: the inner wrapper's (gate_up_proj) and the outer's (down_proj) A and B
    expert_adapters = {n for n in before if ".mlp.experts." in n and ".lora_" in n}
    assert len(expert_adapters) == 4 * len(moe_layers)
    params = dict(actor.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == {n for n in params if ".lora_" in n} and expert_adapters <= trainable
    assert len(actor.optimizer.state) == len(trainable)
    changed = {n for n, p in params.items() if not torch.equal(p, before[n])}
    assert expert_adapters <= changed, f"expert adapters that did not train: {sorted(expert_adapters - changed)}"
    assert changed <= trainable, f"base weights moved: {sorted(changed - trainable)[:3]}"


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_merged_experts_stream_under_transformers_fused_names_and_shapes(variant):
    """float64, random B in every adapter: the merged stream holds transformers' fused names and shapes, in the plain
    model's order; the changed-only stream is exactly the adapted tensors, and each MoE layer's two merged expert
    tensors come out as soon as that layer's last expert part is read."""
    from vlmrl.models.experts import ExpertShape
    from vlmrl.models.tiny import ensure_built

    path = str(ensure_built(variant))
    lora = LoraConfig(rank=4, alpha=8, experts=True)
    model = apply_lora(_base_model(path, torch.float64), lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    state = model.state_dict()
    ours = dict(merged_tensors(state.items(), lora_scaling(lora)))
    assert list(ours) == list(_base_model(path).state_dict())
    shape = ExpertShape.of(model.get_base_model().config)
    fused = {k for k in ours if k.endswith(tuple(f"mlp.experts.{p}" for p in EXPERT_PARAMETERS))}
    assert fused and all(tuple(ours[k].shape) == shape.fused(k.rsplit(".", 1)[1]) for k in fused)

    plain = _base_model(path, torch.float64).state_dict()
    changed = dict(merged_tensors(state.items(), lora_scaling(lora), changed_only=True))
    assert fused <= set(changed) and all(not torch.equal(changed[k], plain[k]) for k in changed)
    assert set(plain) - set(changed) == {k for k in plain if torch.equal(ours[k], plain[k])}

    position = {name: i for i, name in enumerate(state)}
    read = 0

    def counting():
        nonlocal read
        for item in state.items():
            read += 1
            yield item

    for name, _ in merged_tensors(counting(), 2.0, changed_only=True):
        if name in fused:  # its layer's last part: the outer wrapper's lora_B
            last = position[f"base_model.model.{name.rsplit('.', 1)[0]}.lora_B.default.weight"]
            assert read == last + 1, f"{name}: the merge read {read - last - 1} tensors ahead"
    assert list(changed) == merged_names(state, changed_only=True)


def test_expert_adapters_round_trip_through_the_adapter_folder_exactly(trained, qwen3_vl_moe_path, tmp_path):
    """The checkpoint's adapter folder holds the expert adapters under PEFT's names (PEFT's loader reads them back
    unchanged), and a resumed actor (init_path) restores every adapter bit for bit and computes the trained
    policy; the merged model a checkpoint saves computes it too."""
    from peft import PeftModel

    actor, _, batch = trained
    actor.save_adapter(tmp_path)
    ours = adapter_tensors(actor.model.state_dict().items())
    layers = actor.model.get_base_model().config.text_config.num_hidden_layers
    assert sum(".mlp.experts." in k for k in ours) == 4 * layers
    peft = PeftModel.from_pretrained(_base_model(qwen3_vl_moe_path), str(tmp_path / ADAPTER_DIR))
    theirs = adapter_tensors(peft.state_dict().items())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    resumed = expert_lora_actor(qwen3_vl_moe_path, init_path=str(tmp_path))
    restored = adapter_tensors(resumed.model.state_dict().items())
    assert restored.keys() == ours.keys() and all(torch.equal(ours[k], restored[k]) for k in ours)
    trained_logprobs = actor.compute_logprobs(batch)[0]
    assert torch.equal(resumed.compute_logprobs(batch)[0], trained_logprobs)

    merged = actor.full_model()
    assert not any(".lora_" in n or ".base_layer" in n for n, _ in merged.named_parameters())
    plain = Actor(ActorConfig(model_path=qwen3_vl_moe_path, device="cpu", dtype="float32",
                              ppo_micro_batch_size_per_gpu=3), total_steps=1, mini_batch_samples=3)
    plain.model.load_state_dict(merged.state_dict())
    assert torch.allclose(plain.compute_logprobs(batch)[0], trained_logprobs, atol=1e-5)


def test_expert_lora_config_checks_name_what_to_change(tiny_model_path):
    run = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic", "rollout.name=vllm",
           "actor.lora.rank=8", "actor.lora.experts=true"]
    with pytest.raises(ValueError, match="actor.lora.experts=true syncs merged weights"):
        load_config([*run, "actor.lora.sync=adapter"], check_model=False)
    with pytest.raises(ValueError, match="actor.lora.experts=true needs actor.lora.dropout=0"):
        load_config([*run, "actor.lora.dropout=0.1"], check_model=False)
    config = load_config(run, check_model=False)
    lora = config.actor.lora
    assert lora.sync == "auto" and not lora.may_sync_adapter  # auto: merged, and vLLM is not started for LoRA
    from vlmrl.rollout.registry import backend_options

    options = backend_options(config.rollout, "vllm", max_model_len=256, seed=0, lora=lora)
    assert options.lora_rank == 0, "vLLM started to serve an adapter it will never get"
    load_config([*run, "rollout.vllm.sleep_level=2"], check_model=False)  # merged: level 2 drops nothing needed
    with pytest.raises(ValueError, match="actor.lora.experts=true runs on one device for now"):
        load_config([*run, "trainer.n_gpus_per_node=2", "trainer.format_warmup_steps=0"], check_model=False)
    with pytest.raises(ValueError, match="actor.lora.experts=true, but .* is a dense model"):
        peft_config(_base_model(tiny_model_path), LoraConfig(rank=4, experts=True))
