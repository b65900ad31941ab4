"""`vlmrl.models.saving.save_model`, the one writer of model folders: a MoE model's experts land in the family's
checkpoint layout (the one the engines load: tests/moe/test_checkpoints.py starts them on a run's checkpoint),
a LoRA policy's merged experts included, a sharded folder's index names every tensor it holds, and transformers
reloads exactly the weights that were saved."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from vlmrl.models.experts import ExpertShape, to_fused
from vlmrl.models.saving import save_model, to_checkpoint_layout


def _saved(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _moved(model, seed: int = 1) -> None:
    """Every expert tensor moved, so that a file holding the base model's could not pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("variant, layout", [("tiny-qwen3-vl-moe", "fused-transposed"),
                                             ("tiny-qwen3.5-moe", "per-expert")])
def test_a_moved_moe_model_is_saved_in_its_family_layout_and_reloads_exactly(variant, layout, tmp_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built

    model = AutoModelForImageTextToText.from_pretrained(ensure_built(variant), dtype=torch.float32)
    _moved(model)
    save_model(model, tmp_path / "m")
    shape = ExpertShape.of(model.config)
    state = model.state_dict()
    saved = _saved(tmp_path / "m")
    fused = to_fused({k: v for k, v in saved.items() if ".mlp.experts." in k}, layout, shape)
    assert fused.keys() == {k for k in state if ".mlp.experts." in k}
    assert all(torch.equal(fused[k], state[k]) for k in fused)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], state[k]) for k in state)


def test_a_lora_policy_with_expert_adapters_is_checkpointed_merged_in_the_hub_layout(tmp_path):
    """actor.lora.experts: the checkpoint (the actor's merged model, as the fit loop saves it) holds the merged
    experts in Qwen3-VL-MoE's hub layout, and transformers reloads the merged weights."""
    from transformers import AutoModelForImageTextToText

    from tests.rollout.moe_contract import expert_lora_actor
    from vlmrl.models.tiny import ensure_built

    actor = expert_lora_actor(str(ensure_built("tiny-qwen3-vl-moe")))
    merged = dict(actor.named_tensors())
    save_model(actor.full_model(), tmp_path / "m")
    shape = ExpertShape.of(actor.full_model().config)
    saved = _saved(tmp_path / "m")
    gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert saved[gate_up].shape == (shape.experts, shape.hidden, 2 * shape.intermediate)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    assert torch.equal(reloaded[gate_up], merged[gate_up])
    base = AutoModelForImageTextToText.from_pretrained(ensure_built("tiny-qwen3-vl-moe"), dtype=torch.float32)
    assert not torch.equal(base.state_dict()[gate_up], merged[gate_up]), "the adapters changed nothing"


def test_a_sharded_folder_converted_per_expert_keeps_an_index_of_every_tensor(tmp_path):
    """A layout that renames tensors (per expert) rewrites a sharded folder's index with them."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built

    model = AutoModelForImageTextToText.from_pretrained(ensure_built("tiny-qwen3-vl-moe"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "m", max_shard_size="500KB")
    to_checkpoint_layout(tmp_path / "m", "per-expert", ExpertShape.of(model.config))
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    held = {}
    for file in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            held.update({name: file.name for name in f.keys()})
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    assert index == held
    assert not any(name.endswith("experts.gate_up_proj") for name in index)
