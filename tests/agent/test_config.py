"""Agent config: every invalid value is reported with what to change."""

from __future__ import annotations

import pytest

from vlmrl.agent.config import AgentConfig, PartialRolloutConfig, ToolSpec


def test_defaults_are_valid():
    assert AgentConfig().problems() == []
    AgentConfig(tools=[ToolSpec(path="vlmrl.agent.builtin:ImageZoomTool")]).validate()


def test_every_problem_is_listed():
    config = AgentConfig(max_turns=0, tool_timeout_s=0, tool_turn_format="xml",
                         tools=[ToolSpec(path="no_colon"), ToolSpec(path="a:B", name="t"), ToolSpec(path="a:C", name="t")],
                         partial=PartialRolloutConfig(oversample_factor=0.5, unfinished="keep", chunk_tokens=-1))
    problems = "\n".join(config.problems())
    for expected in ("agent.max_turns=0", "agent.tool_timeout_s=0", "agent.tool_turn_format='xml'",
                     "agent.tools[0].path='no_colon'", "duplicate tool names ['t']",
                     "agent.partial.oversample_factor=0.5", "agent.partial.unfinished='keep'",
                     "agent.partial.chunk_tokens=-1"):
        assert expected in problems
    with pytest.raises(ValueError, match="invalid agent configuration"):
        config.validate()
