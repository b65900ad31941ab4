"""Agent loop configuration: tools, turn and token limits, and partial rollout (the run config's `agent` section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOOL_TURN_FORMATS = ("qwen2.5", "template")
UNFINISHED_POLICIES = ("carry", "drop")


@dataclass
class ToolSpec:
    """One tool to register: where its class lives and what to build it with."""

    path: str = ""
    """The tool class: `package.module:ClassName` or `path/to/file.py:ClassName` (a `vlmrl.agent.tools.Tool` subclass)."""
    name: str = ""
    """Name the model calls it by; empty = the class's own `name`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class's constructor (e.g. a zoom tool's output size)."""


@dataclass
class PartialRolloutConfig:
    """Partial rollout: start more groups than a step needs, train on the first ones that finish."""

    enable: bool = False
    """Turn partial rollout on. Off: every started group is finished within its step."""
    oversample_factor: float = 1.5
    """Groups in flight per step = ceil(train_batch_size * this), carried ones included (>= 1). The step ends as
    soon as train_batch_size groups have finished."""
    unfinished: str = "carry"
    """What happens to groups still unfinished when the batch is full: "carry" parks them and resumes them in the
    next step (their tokens keep the policy version that produced them), "drop" releases and discards them."""
    chunk_tokens: int = 0
    """Generate an assistant turn in pieces of at most this many tokens, so that a long turn can be parked between
    pieces instead of holding the step back; 0 = whole turns (a trajectory parks only between turns)."""
    max_staleness: int = 4
    """A carried trajectory whose oldest policy token is more than this many policy versions behind the current one
    is dropped instead of resumed (its tokens would be too far off-policy)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.oversample_factor < 1.0:
            out.append(f"agent.partial.oversample_factor={self.oversample_factor}: must be >= 1 (1 = no over-sampling)")
        if self.unfinished not in UNFINISHED_POLICIES:
            out.append(f"agent.partial.unfinished={self.unfinished!r}: use one of {UNFINISHED_POLICIES}")
        if self.chunk_tokens < 0:
            out.append(f"agent.partial.chunk_tokens={self.chunk_tokens}: must be >= 0 (0 = whole turns)")
        if self.max_staleness < 0:
            out.append(f"agent.partial.max_staleness={self.max_staleness}: must be >= 0")
        return out


@dataclass
class AgentConfig:
    """Multi-turn rollout with tools (`vlmrl.agent.loop.AgentLoop`)."""

    enable: bool = False
    """Roll out training (and validation) samples as multi-turn conversations with the tools below."""
    tools: list[ToolSpec] = field(default_factory=list)
    """Tools the model may call with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    max_turns: int = 4
    """Most assistant turns per trajectory; the trajectory ends after this many even if the last one called a tool."""
    max_response_tokens: int = 2048
    """Most response tokens per trajectory, assistant and tool turns together (usually data.max_response_length).
    A tool turn that would not fit ends the trajectory (finish_reason "length"); nothing is cut through an image."""
    max_turn_tokens: int = 0
    """Most new tokens of one assistant turn; 0 = whatever the response budget has left."""
    max_tool_calls_per_turn: int = 1
    """Calls executed per assistant turn; further calls in the same turn are answered with an error message."""
    tool_timeout_s: float = 30.0
    """A tool call (create, execute, reward or release) taking longer is abandoned; the model is told it timed out."""
    max_tool_response_chars: int = 4096
    """Longer tool text is cut to this many characters (with a marker) before it is tokenized."""
    max_tool_images: int = 4
    """Most images tools may add to one conversation; later ones are not shown (the reply says so). Keep the
    backend's limit_images >= images per prompt + this."""
    tool_turn_format: str = "qwen2.5"
    """How tool output is shown to the model: "qwen2.5" = Qwen2.5's tool format (a user turn holding
    `<tool_response>...</tool_response>` blocks); "template" = the chat template's own `tool` role."""
    max_concurrent_generate: int = 1
    """Backend calls in flight at once. vlmrl's backends run their engine calls one at a time, so 1 is right for
    them: while a call runs, the turns asked for meanwhile gather into the next one. Raise it only for a backend
    that serves concurrent calls."""
    max_requests_per_call: int = 0
    """Most turns batched into one backend call; 0 = no limit."""
    tool_workers: int = 16
    """Threads that run synchronous tool methods (async tools run on the event loop)."""
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Partial rollout (over-sampling, carrying or dropping unfinished groups)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        for name in ("max_turns", "max_response_tokens", "max_tool_calls_per_turn", "max_concurrent_generate",
                     "tool_workers", "max_tool_response_chars"):
            if getattr(self, name) < 1:
                out.append(f"agent.{name}={getattr(self, name)}: must be >= 1")
        if self.max_turn_tokens < 0 or self.max_requests_per_call < 0:
            out.append("agent.max_turn_tokens and agent.max_requests_per_call must be >= 0 (0 = no limit)")
        if self.max_tool_images < 0:
            out.append(f"agent.max_tool_images={self.max_tool_images}: must be >= 0")
        if self.tool_timeout_s <= 0:
            out.append(f"agent.tool_timeout_s={self.tool_timeout_s}: must be > 0")
        if self.tool_turn_format not in TOOL_TURN_FORMATS:
            out.append(f"agent.tool_turn_format={self.tool_turn_format!r}: use one of {TOOL_TURN_FORMATS}")
        for i, spec in enumerate(self.tools):
            if ":" not in spec.path:
                out.append(f"agent.tools[{i}].path={spec.path!r}: write it as `module:ClassName` or "
                           "`file.py:ClassName`")
        names = [spec.name for spec in self.tools if spec.name]
        if len(names) != len(set(names)):
            out.append(f"agent.tools: duplicate tool names {sorted(n for n in set(names) if names.count(n) > 1)}")
        return out + self.partial.problems()

    def validate(self) -> None:
        """Raise ValueError listing every problem (for use outside vlmrl.config, which collects problems itself)."""
        problems = self.problems()
        if problems:
            raise ValueError("invalid agent configuration:\n" + "\n".join(f"  - {p}" for p in problems))
