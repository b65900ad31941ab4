"""Multi-turn rollout with tools (images in and out) and partial rollout; see `vlmrl.agent.loop` and docs/agent.md.

Only the config is imported eagerly: `vlmrl.config` needs `AgentConfig`, and loading a run config must not import
torch. Everything else is imported on first use.
"""

from vlmrl.agent.config import AgentConfig, PartialRolloutConfig, ToolSpec
from vlmrl.utils.lazy import lazy_exports

_LAZY = {
    "AgentBatch": "loop", "AgentLoop": "loop", "Group": "loop",
    "ToolCall": "parser", "ToolCallError": "parser", "parse_tool_calls": "parser",
    "Tool": "tools", "ToolContext": "tools", "ToolOutput": "tools", "ToolRegistry": "tools",
    "TOOL_VERSION": "trajectory", "AgentSample": "trajectory", "Trajectory": "trajectory",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["AgentConfig", "PartialRolloutConfig", "ToolSpec", *sorted(_LAZY)]
