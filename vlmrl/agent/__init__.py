"""Multi-turn rollout with tools (images in and out) and partial rollout; see `vlmrl.agent.loop` and docs/agent.md."""

from vlmrl.agent.config import AgentConfig, PartialRolloutConfig, ToolSpec
from vlmrl.agent.loop import AgentBatch, AgentLoop, Group
from vlmrl.agent.parser import ToolCall, ToolCallError, parse_tool_calls
from vlmrl.agent.tools import Tool, ToolContext, ToolOutput, ToolRegistry
from vlmrl.agent.trajectory import TOOL_VERSION, AgentSample, Trajectory

__all__ = [
    "TOOL_VERSION",
    "AgentBatch",
    "AgentConfig",
    "AgentLoop",
    "AgentSample",
    "Group",
    "PartialRolloutConfig",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolContext",
    "ToolOutput",
    "ToolRegistry",
    "ToolSpec",
    "Trajectory",
    "parse_tool_calls",
]
