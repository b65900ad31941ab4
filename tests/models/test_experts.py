"""The MoE families' expert layouts (`vlmrl.models.experts`) and the embedded MoE models: the conversion both
ways, its refusals, and that transformers, given the folder vlmrl writes, holds exactly the weights it was built
with (transformers' own save of Qwen3-VL-MoE is the one no engine loads)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from vlmrl.models.experts import ExpertShape, convert, convert_names, to_fused
from vlmrl.models.families import QWEN3_5_MOE, QWEN3_VL, QWEN3_VL_MOE, family_for_path, family_of

SHAPE = ExpertShape(experts=3, intermediate=5, hidden=8)
PREFIX = "model.language_model.layers.0.mlp.experts"


def fused_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"model.language_model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen),
            f"{PREFIX}.gate_up_proj": torch.randn(SHAPE.fused("gate_up_proj"), generator=gen),
            f"{PREFIX}.down_proj": torch.randn(SHAPE.fused("down_proj"), generator=gen)}


@pytest.mark.parametrize("layout", ["fused", "fused-transposed", "per-expert"])
def test_every_layout_converts_back_to_the_same_tensors(layout):
    state = fused_state()
    converted = list(convert(state.items(), layout, SHAPE))
    assert [name for name, _ in converted] == convert_names(state, layout, SHAPE), "names announced == names sent"
    back = to_fused(dict(converted), "fused" if layout == "per-expert" else layout, SHAPE)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_per_expert_and_transposed_tensors_are_what_the_engines_read():
    """Per expert: gate = the first I rows of expert e's gate_up, up = the next I, down = expert e's (H, I) slice;
    fused-transposed: (E, H, 2I) and (E, I, H), the hub layout."""
    state = fused_state()
    gate_up, down = state[f"{PREFIX}.gate_up_proj"], state[f"{PREFIX}.down_proj"]
    per = dict(convert(state.items(), "per-expert", SHAPE))
    assert torch.equal(per[f"{PREFIX}.1.gate_proj.weight"], gate_up[1, :5])
    assert torch.equal(per[f"{PREFIX}.1.up_proj.weight"], gate_up[1, 5:])
    assert torch.equal(per[f"{PREFIX}.2.down_proj.weight"], down[2])
    assert len([n for n in per if ".experts." in n]) == 3 * 3
    hub = dict(convert(state.items(), "fused-transposed", SHAPE))
    assert hub[f"{PREFIX}.gate_up_proj"].shape == (3, 8, 10) and hub[f"{PREFIX}.down_proj"].shape == (3, 5, 8)
    assert hub[f"{PREFIX}.gate_up_proj"].is_contiguous()


def test_a_tensor_already_transposed_is_refused_not_transposed_again():
    state = fused_state()
    state[f"{PREFIX}.down_proj"] = state[f"{PREFIX}.down_proj"].transpose(1, 2)
    with pytest.raises(ValueError, match=r"down_proj: shape \(3, 5, 8\), but transformers holds it as \(3, 8, 5\).*"
                                         "refusing to guess its orientation"):
        list(convert(state.items(), "fused-transposed", SHAPE))
    with pytest.raises(ValueError, match="cannot be told from its shape"):
        ExpertShape(experts=2, intermediate=4, hidden=8).check_orientable()
    with pytest.raises(ValueError, match="unknown expert layout"):
        list(convert(state.items(), "transposed", SHAPE))


@pytest.mark.parametrize("variant, family, layout", [("tiny-qwen3-vl-moe", QWEN3_VL_MOE, "fused-transposed"),
                                                     ("tiny-qwen3.5-moe", QWEN3_5_MOE, "per-expert")])
def test_the_embedded_moe_models_are_saved_in_their_family_layout_and_load_as_built(variant, family, layout):
    """The folder holds the experts in the layout the engines load (Qwen3-VL-MoE: the hub's transposed one, which
    transformers 5.19's save_pretrained does not write), and transformers loads it to the very tensors of the
    seeded build (a per-expert Qwen3-VL-MoE folder would load random experts without an error)."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models import tiny
    from vlmrl.models.tiny import common

    path = tiny.ensure_built(variant)
    assert family_for_path(path) is family and family.experts.checkpoint_layout == layout
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert family_of(model.config) is family
    shape = ExpertShape.of(model.config)
    assert shape == ExpertShape(4, 48, 128)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    state = model.state_dict()
    assert to_fused(saved, layout, shape).keys() == state.keys()
    assert all(torch.equal(to_fused(saved, layout, shape)[k], state[k]) for k in state)
    torch.manual_seed(common.SEED)
    fresh = type(model)(model.config).to(torch.float32)
    common.seeded_init(fresh)
    assert all(torch.equal(fresh.state_dict()[k], state[k]) for k in state), "reload != the seeded build"


def test_sglang_is_refused_where_it_would_compute_another_moe_model():
    """SGLang's Qwen3-VL-MoE adds three deepstack embeddings whatever the config says; its Qwen3.5-MoE needs AMX on
    a CPU. Both are named before an engine starts; vLLM takes both."""
    two = {"vision_config": {"deepstack_visual_indexes": [0, 1]},
           "text_config": {"rope_parameters": {"mrope_interleaved": True}}}
    assert any("adds exactly 3" in p for p in QWEN3_VL_MOE.engine_problems(two, "sglang"))
    assert QWEN3_VL_MOE.engine_problems(two, "vllm") == [] and QWEN3_VL.engine_problems(two, "sglang") == []
    three = {**two, "vision_config": {"deepstack_visual_indexes": [0, 1, 2]}}
    assert QWEN3_VL_MOE.engine_problems(three, "sglang") == []
    # SGLang builds every Qwen3-VL-MoE layer as MoE: a config with a dense layer is another model there
    for dense in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        text = {**three["text_config"], "num_experts": 4, "num_hidden_layers": 3, **dense}
        config = {**three, "text_config": text}
        assert any("dense decoder layers" in p for p in QWEN3_VL_MOE.engine_problems(config, "sglang")), dense
        assert QWEN3_VL_MOE.engine_problems(config, "vllm") == []
    from vlmrl.models.families import cpu_has_amx

    problems = QWEN3_5_MOE.cpu_engine_problems({}, "sglang", "bfloat16")
    assert bool(problems) != cpu_has_amx()
    assert QWEN3_5_MOE.cpu_engine_problems({}, "vllm", "bfloat16") == []


def test_engine_routing_rows_keep_transformers_moe_layers_in_the_trainers_order():
    """The engines report routing per token for every decoder layer (vLLM: (tokens, layers, k) numpy; SGLang: the
    same rows as base64 int32, encoded as its detokenizer does). `RoutingLayout` keeps the layers transformers
    builds a sparse MoE block for (its own rule, checked on a model built from the config) as (MoE layers,
    tokens, k), and refuses rows of another width instead of guessing."""
    import base64
    import json

    import numpy as np
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.experts import RoutingLayout
    from vlmrl.models.tiny import ensure_built

    path = ensure_built("tiny-qwen3-vl-moe")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(num_hidden_layers=5, mlp_only_layers=[1], decoder_sparse_step=1)
    layout = RoutingLayout.of(raw)
    config = AutoConfig.from_pretrained(path)
    config.text_config.num_hidden_layers, config.text_config.mlp_only_layers = 5, [1]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    sparse = tuple(i for i, layer in enumerate(model.model.language_model.layers) if hasattr(layer.mlp, "experts"))
    assert layout.moe_layers == sparse == (0, 2, 3, 4) and layout.top_k == config.text_config.num_experts_per_tok
    tokens, k = 7, layout.top_k
    rows = np.random.default_rng(0).integers(0, 4, size=(tokens, 5, k)).astype(np.int32)
    expected = torch.as_tensor(rows[:, list(sparse)]).permute(1, 0, 2).long()
    assert torch.equal(layout.from_engine(rows, "vllm"), expected)
    encoded = base64.b64encode(torch.as_tensor(rows).numpy().tobytes()).decode("utf-8")  # SGLang's detokenizer
    decoded = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    assert torch.equal(layout.from_engine(decoded, "sglang"), expected)
    with pytest.raises(ValueError, match="expected \\(tokens, 5 layers"):
        layout.from_engine(rows[:, :3], "vllm")
    with pytest.raises(ValueError, match="do not divide"):
        layout.from_engine(decoded[:-1], "sglang")
    every = RoutingLayout.of(json.loads((ensure_built("tiny-qwen3.5-moe") / "config.json").read_text()))
    assert every.moe_layers == tuple(range(every.hidden_layers))
