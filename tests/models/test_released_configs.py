"""The released configs vlmrl ships (vlmrl/models/released_configs/) build their models, count the parameters the
model cards publish, are cited in the README beside them, and are read only where no config.json is at hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrl.actor.config import ActorConfig
from vlmrl.models.families import family_of
from vlmrl.models.released import RELEASED_CONFIGS, model_config, released_models
from vlmrl.trainer.memory_model import model_facts

PUBLISHED = {  # the model cards' parameter counts (Hugging Face's safetensors total, 3 significant figures)
    "Qwen/Qwen2.5-VL-3B-Instruct": 3.75e9,
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29e9,
    "Qwen/Qwen2.5-VL-72B-Instruct": 73.4e9,
    "Qwen/Qwen3-VL-8B-Instruct": 8.77e9,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": 31.1e9,
    "zai-org/GLM-4.1V-9B-Thinking": 10.3e9,
    "OpenGVLab/InternVL3_5-8B-HF": 8.53e9,
}


@pytest.mark.parametrize("model", released_models())
def test_a_released_config_builds_its_model_of_a_supported_family(model):
    raw, source = model_config(model)
    assert Path(source).parent == RELEASED_CONFIGS
    facts = model_facts(ActorConfig(model_path=model))
    assert facts.family == family_of(raw).name and facts.parameters > 1e9
    if model in PUBLISHED:
        assert round(facts.parameters, -7) == pytest.approx(PUBLISHED[model], rel=0.002), facts.parameters


def test_every_recipe_model_is_shipped_and_cited():
    """The hub id every geo3k recipe names has its config here, and the README says where each file came from."""
    readme = (RELEASED_CONFIGS / "README.md").read_text()
    recipes = Path(__file__).resolve().parents[2] / "examples" / "configs"
    named = {line.split(":", 1)[1].strip() for path in recipes.glob("*_geo3k.yaml")
             for line in path.read_text().splitlines() if line.strip().startswith("model_path:")}
    assert named <= set(released_models()), named - set(released_models())
    for model in released_models():
        assert f"`{model}`" in readme, f"{model} is not cited in released_configs/README.md"


def test_a_local_config_wins_and_an_unknown_hub_id_says_what_was_looked_for(tmp_path):
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert model_config(str(folder)) == ({"model_type": "qwen2_5_vl"}, str(folder / "config.json"))
    with pytest.raises(FileNotFoundError, match="not downloaded .* and not one of the released configs"):
        model_config("org/not-released")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_config(str(tmp_path))
