"""The agent examples: their configs give valid agent sections whose tools build; the data script adds the tools
prompt to a verl-schema parquet and the processor renders it."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vlmrl.agent.config import AgentConfig
from vlmrl.agent.tools import ToolRegistry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agent"
CONFIGS = sorted(EXAMPLES.glob("*.yaml"))


def _script():
    spec = importlib.util.spec_from_file_location("add_tools_prompt", EXAMPLES / "add_tools_prompt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config_file", CONFIGS, ids=[c.name for c in CONFIGS])
def test_example_agent_sections_are_valid(config_file):
    raw = OmegaConf.load(config_file)
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AgentConfig), raw.agent))
    assert config.enable and config.problems() == []
    assert config.max_response_tokens == raw.data.max_response_length
    assert len(ToolRegistry.from_specs(config.tools)) == len(config.tools) >= 1


def test_add_tools_prompt(tmp_path, tiny_model_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmrl.processors.loading import load_processor

    script = _script()
    assert doctest.testmod(script).failed == 0
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"},
            {"data_source": "x", "prompt": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "And 2+2?"}], "answer": "4"}]
    source, target = tmp_path / "in.parquet", tmp_path / "out" / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    tools = script.tools_prompt_of(str(EXAMPLES / "geo3k_check_answer.yaml"), "Check once.")
    assert script.convert(str(source), str(target), tools) == 2
    converted = pq.read_table(target).to_pylist()
    assert [r["answer"] for r in converted] == ["2", "4"]
    first, second = (r["prompt"] for r in converted)
    assert first[0]["role"] == "system" and first[0]["content"].startswith("You are a helpful assistant.\n\n# Tools")
    assert second[0]["content"].startswith("Be brief.\n\n# Tools") and second[0]["content"].endswith("Check once.")
    request = load_processor(tiny_model_path).build_request(converted[0], index=0)
    text = load_processor(tiny_model_path).tokenizer.decode(request.prompt_ids)
    assert '"name": "check_answer"' in text and text.count("<|im_start|>system") == 1


# the released models' image processor bounds (preprocessor_config.json min_pixels / max_pixels)
RELEASED_PIXEL_BOUNDS = {"tiny": (3136, 12845056), "tiny-qwen3-vl": (65536, 16777216)}


@pytest.mark.parametrize("config_file", CONFIGS, ids=[c.name for c in CONFIGS])
@pytest.mark.parametrize("model", sorted(RELEASED_PIXEL_BOUNDS))
def test_example_pixel_bounds_suit_both_families(config_file, model, tmp_path):
    """An agent example's data section loads a processor for Qwen2.5-VL and for Qwen3-VL (each embedded model given
    its released model's pixel bounds): min_pixels is the model's own, max_pixels the example's. A Qwen2.5-VL
    min_pixels of 3136 is below Qwen3-VL's 65536 and is refused."""
    import json
    import shutil

    from vlmrl.config import load_config
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    folder = tmp_path / model
    shutil.copytree(ensure_built(model), folder)
    low, high = RELEASED_PIXEL_BOUNDS[model]
    processor_config = json.loads((folder / "processor_config.json").read_text())
    processor_config["image_processor"]["size"] = {"shortest_edge": low, "longest_edge": high}
    (folder / "processor_config.json").write_text(json.dumps(processor_config))
    data = load_config([f"config={config_file}"], check_model=False).data
    processor = load_processor(str(folder), data)
    assert (processor.min_pixels, processor.max_pixels) == (low, data.max_pixels)
    if low > 3136:
        data.min_pixels = 3136
        with pytest.raises(ValueError, match="must lie within the model's image processor bounds"):
            load_processor(str(folder), data)
