"""Tools the model can call, their per-trajectory lifecycle, and the registry that builds them from config.

A tool is a class with four methods, each either plain or `async`:

- `create(context) -> state`: once per trajectory, when it starts (e.g. remember the prompt image or the answer);
- `execute(state, arguments) -> ToolOutput | str`: once per call the model makes;
- `reward(state) -> float | None`: once when the trajectory ends (logged as `reward_extra["tool/<name>"]`);
- `release(state)`: once when the trajectory ends or is dropped, whatever happened before.

Two more for checkpoints (partial rollout carries unfinished trajectories across a resume): `save_state(state)` gives a
JSON-able copy of the state, `load_state(context, saved)` rebuilds it. The default (`save_state` returns None) calls
`create(context)` again on resume, which is exact for a state that depends only on the context.

Plain methods run in a thread pool, async ones on the event loop; every call has a timeout. A tool that raises or
times out never crashes the step: the model gets an error message as the tool's reply.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.agent.config import ToolSpec
from vlmrl.types import RolloutRequest


@dataclass
class ToolContext:
    """What a tool knows about the trajectory it serves."""

    request: RolloutRequest
    """The prompt (its resized images, ground truth, extra_info)."""
    sample_index: int
    """Which of the group's samples this trajectory is."""

    @property
    def trajectory_id(self) -> str:
        return f"{self.request.uid}/{self.sample_index}"


@dataclass
class ToolOutput:
    """A tool's reply. Images are shown to the model (resized by the processor's rules first)."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to log (summed per tool over the step)."""


class Tool:
    """Base class of a tool; override `execute` (and the other lifecycle methods where needed)."""

    name: str = ""
    """What the model calls it by."""
    description: str = ""
    """One line for the model (goes into the tools system prompt)."""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    """JSON schema of the arguments (goes into the tools system prompt)."""

    def create(self, context: ToolContext) -> Any:
        return None

    def execute(self, state: Any, arguments: dict[str, Any]) -> ToolOutput | str:
        raise NotImplementedError(f"tool {self.name!r} does not implement execute")

    def reward(self, state: Any) -> float | None:
        return None

    def release(self, state: Any) -> None:
        return None

    def save_state(self, state: Any) -> Any:
        """A JSON-able copy of `state` for a checkpoint, or None (the default): then the resumed run calls
        `create(context)` again, which is right when the state depends only on the context (the prompt, its images).
        Override both this and `load_state` when `execute` changes the state (e.g. remembers earlier calls)."""
        return None

    def load_state(self, context: ToolContext, saved: Any) -> Any:
        """The state `save_state` returned `saved` for, rebuilt in a resumed run."""
        raise NotImplementedError(f"tool {self.name!r} saves its state but does not implement load_state")

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Qwen function schema of this tool."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


_DEFAULTS = frozenset({Tool.create, Tool.reward, Tool.release, Tool.save_state})
"""Lifecycle methods a tool did not override: they return None at once, so they run inline."""


class ToolTimeout(Exception):
    """A tool method ran past `agent.tool_timeout_s`."""


async def call_tool_method(method: Callable[..., Any], *args: Any, timeout_s: float, executor: Executor | None) -> Any:
    """Run one lifecycle method with a timeout: async methods on the loop, plain ones in `executor`.

    A plain method that overruns keeps its thread until it returns (Python cannot kill a thread); the caller moves on
    (give a `vlmrl.utils.executor.DaemonExecutor`, so such a thread cannot hold up the interpreter's exit).
    """
    if getattr(method, "__func__", None) in _DEFAULTS:
        return method(*args)  # Tool's own no-op: no thread hop, so the turns' order cannot depend on thread timing
    if inspect.iscoroutinefunction(method):
        work = method(*args)
    else:
        work = asyncio.get_running_loop().run_in_executor(executor, functools.partial(method, *args))
    try:
        return await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError as err:
        raise ToolTimeout(f"timed out after {timeout_s:g} s") from err


def as_output(value: ToolOutput | str | None) -> ToolOutput:
    """A tool may return plain text; anything else must be a ToolOutput."""
    if isinstance(value, ToolOutput):
        bad = [type(im).__name__ for im in value.images if not isinstance(im, Image.Image)]
        if bad:
            raise TypeError(f"ToolOutput.images must be PIL images, got {bad}")
        return value
    if isinstance(value, str):
        return ToolOutput(text=value)
    if value is None:
        return ToolOutput()
    raise TypeError(f"a tool must return a ToolOutput or a str, got {type(value).__name__}")


class ToolRegistry:
    """The tools of a run, by name."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if not tool.name:
            raise ValueError(f"tool {type(tool).__name__} has no name: set its `name` attribute or ToolSpec.name")
        if tool.name in self._tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __iter__(self):
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @classmethod
    def from_specs(cls, specs: Sequence[ToolSpec]) -> ToolRegistry:
        """Build every tool of `agent.tools`; an import or constructor error names the spec."""
        tools = []
        for i, spec in enumerate(specs):
            try:
                tool_cls = load_object(spec.path)
                tool = tool_cls(**spec.kwargs)
            except Exception as err:
                raise ValueError(f"agent.tools[{i}] ({spec.path!r}): cannot build the tool: {err}") from err
            if not isinstance(tool, Tool):
                raise ValueError(f"agent.tools[{i}] ({spec.path!r}) is a {type(tool).__name__}, not a vlmrl.agent.tools.Tool")
            if spec.name:
                tool.name = spec.name
            tools.append(tool)
        return cls(tools)

    def system_prompt(self) -> str:
        """Qwen2.5's tool instructions listing these tools: put it in the system message of each prompt."""
        lines = [json.dumps(tool.schema(), ensure_ascii=False) for tool in self]
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(lines)
            + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


def load_object(path: str) -> Any:
    """`package.module:Name` or `path/to/file.py:Name` -> the object."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r}: write it as `module:Name` or `file.py:Name`")
    if module_name.endswith(".py"):
        file = Path(module_name).resolve()
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist")
        unique = f"vlmrl_user_tool_{abs(hash(str(file)))}"
        module = sys.modules.get(unique)
        if module is None:
            spec = importlib.util.spec_from_file_location(unique, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[unique] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise AttributeError(f"{module_name} has no {attr!r}") from err
