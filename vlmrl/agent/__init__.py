"""Multi-turn rollout with tools (images in and out) and partial rollout; see `vlmrl.agent.loop` and docs/agent.md.

Only the config is imported eagerly: `vlmrl.config` needs `AgentConfig`, and loading a run config must not import
torch. Everything else is imported on first use.
"""

from importlib import import_module

from vlmrl.agent.config import AgentConfig, PartialRolloutConfig, ToolSpec

_LAZY = {
    "AgentBatch": "loop", "AgentLoop": "loop", "Group": "loop",
    "ToolCall": "parser", "ToolCallError": "parser", "parse_tool_calls": "parser",
    "Tool": "tools", "ToolContext": "tools", "ToolOutput": "tools", "ToolRegistry": "tools",
    "TOOL_VERSION": "trajectory", "AgentSample": "trajectory", "Trajectory": "trajectory",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"vlmrl.agent.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlmrl.agent' has no attribute {name!r}")


__all__ = ["AgentConfig", "PartialRolloutConfig", "ToolSpec", *sorted(_LAZY)]
