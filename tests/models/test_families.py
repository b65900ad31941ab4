"""vlmrl.models.families: each family's facts checked against the embedded model of that family (what transformers
builds and saves), not against copies of the same constants."""

from __future__ import annotations

import copy
import doctest
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vlmrl
import vlmrl.models.families
import vlmrl.models.family_parts
from vlmrl.models.families import (
    FAMILIES,
    QWEN2_5_VL,
    QWEN3_5,
    QWEN3_VL,
    family_for_path,
    family_of,
    mrope_interleaved,
    read_model_config,
)


def test_doctests():
    for module in (vlmrl.models.families, vlmrl.models.family_parts):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.fixture(scope="module")
def glm_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-glm4v"))


@pytest.fixture(scope="module")
def internvl_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-internvl"))


@pytest.fixture(scope="module")
def built(tiny_model_path, tiny_qwen3_vl_path, tiny_qwen3_5_path, glm_path, internvl_path):
    """{family name: (folder, model)} for the embedded models."""
    from transformers import AutoModelForImageTextToText

    return {family_for_path(path).name: (Path(path), AutoModelForImageTextToText.from_pretrained(path,
                                                                                                   dtype=torch.float32))
            for path in (tiny_model_path, tiny_qwen3_vl_path, tiny_qwen3_5_path, glm_path, internvl_path)}


def test_each_embedded_model_has_its_family(tiny_model_path, tiny_qwen3_vl_path, tiny_qwen3_5_path):
    assert family_for_path(tiny_model_path) is QWEN2_5_VL
    assert family_for_path(tiny_qwen3_vl_path) is QWEN3_VL
    assert family_for_path(tiny_qwen3_5_path) is QWEN3_5
    # a transformers config object and config.json as a dict give the same answer
    from transformers import AutoConfig

    assert family_of(AutoConfig.from_pretrained(tiny_qwen3_vl_path)) is QWEN3_VL
    assert family_of({"model_type": "qwen2_vl"}) is QWEN2_5_VL
    assert len({t for f in FAMILIES for t in f.model_types}) == sum(len(f.model_types) for f in FAMILIES)


def test_each_familys_recipes_exist_and_its_hub_id_pattern_names_its_released_models():
    """The launcher picks `recipe` (or a size's own) for a model of the family, and knows a model not downloaded
    yet by `hub_id_pattern`: every recipe named is a config file, and each released config vlmrl ships is of the
    family its hub id's name says (family_for_hub_id refuses an id two patterns match)."""
    from vlmrl.models.families import family_for_hub_id
    from vlmrl.models.released import RELEASED_CONFIGS, released_models

    configs = Path(vlmrl.__file__).parents[1] / "examples" / "configs"
    for family in FAMILIES:
        for recipe in (family.recipe, *(name for _, name in family.recipe_by_size)):
            assert (configs / f"{recipe}.yaml").exists(), (family.name, recipe)
    for repo in released_models():
        config = json.loads((RELEASED_CONFIGS / f"{repo.replace('/', '--', 1)}.json").read_text())
        assert family_for_hub_id(repo) is family_of(config), repo
    assert QWEN2_5_VL.recipe_for("Qwen/Qwen2.5-VL-32B-Instruct") == "qwen2_5_vl_32b_geo3k"


def test_an_unsupported_model_is_refused_naming_it_and_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match=r"architecture LlavaForConditionalGeneration is not supported; vlmrl "
                                         r"handles Qwen2.5-VL \(qwen2_vl / qwen2_5_vl\), Qwen3-VL \(qwen3_vl\), "
                                         r"Qwen3.5 \(qwen3_5\), Qwen3-VL-MoE \(qwen3_vl_moe\), Qwen3.5-MoE "
                                         r"\(qwen3_5_moe\), GLM-4.1V \(glm4v\) and InternVL3.5 \(internvl\)"):
        family_of({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4v_moe"}))
    with pytest.raises(ValueError, match=f"{tmp_path}: architecture model_type='glm4v_moe' is not supported"):
        family_for_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="is .* a Hugging Face model folder"):
        read_model_config(tmp_path / "missing")


def test_checkpoint_names_are_the_names_transformers_saves(built):
    """Weight sync renames in-memory parameters with checkpoint_name for the engines, which load checkpoint names:
    for every parameter the renamed name must be the one in the saved safetensors (the engines' loaders map those)."""
    for name, (folder, model) in built.items():
        family = family_for_path(folder)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            saved = set(f.keys())
        renamed = {family.weights.checkpoint_name(n) for n, _ in model.named_parameters()}
        assert renamed == saved, f"{name}: renamed but not saved {sorted(renamed - saved)[:4]}, " \
                                 f"saved but not renamed {sorted(saved - renamed)[:4]}"


def test_vision_paths_name_the_tower_and_every_merger(built):
    """VisionAlwaysOn and the frozen-tower option find the modules by these paths; the mergers named must be the
    modules whose outputs leave the tower (for Qwen3-VL: the final merger and each deepstack merger)."""
    for name, (folder, model) in built.items():
        family = family_for_path(folder)
        tower = model.get_submodule(family.weights.vision_tower)
        if family.weights.vision_projector is not None:  # InternVL: the projector after the tower, outside it
            assert tower is model.model.vision_tower and not family.weights.vision_mergers, name
            assert model.get_submodule(family.weights.vision_projector) is model.model.multi_modal_projector
            continue
        assert tower is model.model.visual, name
        merger_params = {n for path in family.weights.vision_mergers
                         for n, _ in tower.get_submodule(path).named_parameters()}
        assert merger_params, name
    qwen3 = built["Qwen3-VL"][1]
    deepstack = qwen3.config.vision_config.deepstack_visual_indexes
    assert len(qwen3.get_submodule("model.visual.deepstack_merger_list")) == len(deepstack) == 2


def test_a_qwen3_vl_config_without_the_interleaving_flag_is_an_engine_problem(tiny_model_path, tiny_qwen3_vl_path):
    good = read_model_config(tiny_qwen3_vl_path)
    assert mrope_interleaved(good) and QWEN3_VL.engine_problems(good) == []
    bad = copy.deepcopy(good)
    del bad["text_config"]["rope_parameters"]["mrope_interleaved"]
    problems = QWEN3_VL.engine_problems(bad)
    assert len(problems) == 1 and '"mrope_interleaved": true' in problems[0]
    # the older spelling (rope_scaling) carries the flag as well
    old = copy.deepcopy(bad)
    old["text_config"]["rope_scaling"] = {"mrope_section": [12, 10, 10], "mrope_interleaved": True}
    assert QWEN3_VL.engine_problems(old) == []
    # Qwen2.5-VL never interleaves: no flag needed
    assert QWEN2_5_VL.engine_problems(read_model_config(tiny_model_path)) == []


def test_transformers_interleaves_qwen3_vl_mrope_whatever_the_config_says(tiny_qwen3_vl_path):
    """The fact behind `interleaved_mrope`: HF's Qwen3-VL logits do not change when the flag is dropped (it always
    interleaves), so the flag is only for the engines, and an engine without it would compute something else."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    ids = torch.tensor([[1, 5, 9, 300, 301, 302, 303, 17]])
    # positions where t, h and w differ, as inside an image: interleaving changes which frequency sees which
    positions = torch.stack([torch.arange(8), torch.arange(8) * 2, torch.arange(8) * 3])[:, None, :]
    config = AutoConfig.from_pretrained(tiny_qwen3_vl_path)
    flagged = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path, config=config, dtype=torch.float32)
    unflagged_config = copy.deepcopy(config)
    unflagged_config.text_config.rope_parameters.pop("mrope_interleaved", None)
    unflagged = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path, config=unflagged_config,
                                                            dtype=torch.float32)
    with torch.no_grad():
        a = flagged(input_ids=ids, position_ids=positions).logits
        b = unflagged(input_ids=ids, position_ids=positions).logits
    assert torch.equal(a, b)


def test_linear_attention_names_the_gated_deltanet_mixers_and_their_projections(built):
    """The packed forward finds the Qwen3.5 layers that carry state by `linear_attention`, LoRA their projections by
    `linear_attention_projections`: every one is a Linear of each such mixer, and together they are all of them."""
    _, model = built["Qwen3.5"]
    layers = model.model.language_model.layers
    mixer = QWEN3_5.weights.linear_attention
    mixers = [getattr(layer, mixer) for layer in layers if hasattr(layer, mixer)]
    assert [type(m).__name__ for m in mixers] == ["Qwen3_5GatedDeltaNet"] * 2
    for mixer in mixers:
        linears = {n for n, m in mixer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linears == set(QWEN3_5.weights.linear_attention_projections)
    assert all(f.weights.linear_attention is None for f in (QWEN2_5_VL, QWEN3_VL))


def test_a_qwen3_5_config_sglang_would_build_other_layers_from_is_an_engine_problem(tiny_qwen3_5_path):
    """SGLang builds a Qwen3.5's layers from full_attention_interval alone, transformers and vLLM from layer_types:
    missing, the interval is an SGLang problem that the override settles; layer_types no interval can express are
    one it cannot settle."""
    good = read_model_config(tiny_qwen3_5_path)
    assert QWEN3_5.engine_problems(good) == [] and QWEN3_5.engine_overrides(good) == {}
    missing = copy.deepcopy(good)
    del missing["text_config"]["full_attention_interval"]
    assert QWEN3_5.engine_problems(missing, "vllm") == []
    (problem,) = QWEN3_5.engine_problems(missing, "sglang")
    assert "full_attention_interval=None where its layer_types say 3" in problem
    assert QWEN3_5.engine_overrides(missing) == {"text_config": {"full_attention_interval": 3}}
    odd = copy.deepcopy(good)
    odd["text_config"]["layer_types"] = ["full_attention", "linear_attention", "linear_attention"]
    (problem,) = QWEN3_5.engine_problems(odd, "sglang-server")
    assert "no full_attention_interval can express" in problem


def test_a_qwen3_5_config_without_interleaving_gets_the_flag_where_each_engine_reads_it(tiny_qwen3_5_path):
    bad = read_model_config(tiny_qwen3_5_path)
    del bad["text_config"]["rope_parameters"]["mrope_interleaved"]
    assert len(QWEN3_5.engine_problems(bad)) == 1
    text = QWEN3_5.engine_overrides(bad)["text_config"]
    assert text["rope_parameters"]["mrope_interleaved"] is True and text["rope_scaling"] == text["rope_parameters"]
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_cpu_engine_problems_name_the_dtype_and_head_size_vllm_takes(tiny_qwen3_5_path):
    config = read_model_config(tiny_qwen3_5_path)
    assert QWEN3_5.cpu_engine_problems(config, "vllm", "bfloat16") == []
    (dtype,) = QWEN3_5.cpu_engine_problems(config, "sglang", "float32")
    assert "rollout.dtype=bfloat16 or auto" in dtype
    small = copy.deepcopy(config)
    small["text_config"]["linear_key_head_dim"] = 32
    assert QWEN3_5.cpu_engine_problems(small, "sglang", "bfloat16") == []
    (head,) = QWEN3_5.cpu_engine_problems(small, "vllm", "bfloat16")
    assert "{'linear_key_head_dim': 32}" in head


def test_a_glm4v_config_without_attention_bias_is_a_vllm_problem_that_the_overrides_settle(glm_path):
    """transformers' GLM-4.1V text attention has q/k/v biases whatever the config says (a model built from a config
    with attention_bias false still has them); vLLM builds them only when text_config says attention_bias: true.
    Such a config is a vLLM problem (not SGLang's, measured equal to HF without it), and the family's engine
    overrides carry the flag."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.families import GLM4V

    good = read_model_config(glm_path)
    assert family_for_path(glm_path) is GLM4V and good["text_config"]["attention_bias"] is True
    assert GLM4V.engine_problems(good) == [] and GLM4V.engine_overrides(good) == {}
    bad = copy.deepcopy(good)
    del bad["text_config"]["attention_bias"]
    problems = GLM4V.engine_problems(bad, "vllm")
    assert len(problems) == 1 and '"attention_bias": true' in problems[0]
    assert GLM4V.engine_problems(bad, "sglang") == []
    assert GLM4V.engine_overrides(bad) == {"text_config": {"attention_bias": True}}
    config = AutoConfig.from_pretrained(glm_path)
    config.text_config.attention_bias = False
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    attention = model.model.language_model.layers[0].self_attn
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
