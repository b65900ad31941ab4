"""The agent examples: their configs give valid agent sections whose tools build; the data script adds the tools
prompt to a verl-schema parquet and the processor renders it."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vlmrl.agent import AgentConfig, ToolRegistry

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

    from vlmrl.processors import load_processor

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
