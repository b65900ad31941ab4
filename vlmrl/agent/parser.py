"""Parse Qwen2.5-style tool calls out of an assistant turn's text.

Qwen2.5 (and Qwen2.5-VL) write a call as::

    <tool_call>
    {"name": "zoom", "arguments": {"box": [0, 0, 56, 56]}}
    </tool_call>

A turn may hold several calls. A malformed call is not dropped silently: it becomes a `ToolCallError` that the loop
answers with an error message, so the model can learn the format from the reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    """One well-formed call."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallError:
    """A call the model tried to make but wrote wrongly; `message` is what the model is told."""

    message: str
    raw: str = ""


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every call in `text`, in order; malformed ones as ToolCallError.

    >>> parse_tool_calls('I will zoom.<tool_call>\\n{"name": "zoom", "arguments": {"x": 1}}\\n</tool_call>')
    [ToolCall(name='zoom', arguments={'x': 1})]
    >>> parse_tool_calls("no call here")
    []
    >>> parse_tool_calls('<tool_call>{"name": "zoom"')[0].message
    'tool call is not closed with </tool_call>'
    """
    out: list[ToolCall | ToolCallError] = []
    end = 0
    for match in _CALL.finditer(text):
        out.append(_parse_one(match.group(1).strip()))
        end = match.end()
    if CALL_OPEN in text[end:]:  # an opening tag after the last complete call: cut off or never closed
        raw = text[end:].split(CALL_OPEN, 1)[1]
        out.append(ToolCallError(f"tool call is not closed with {CALL_CLOSE}", raw=raw))
    return out


def _parse_one(raw: str) -> ToolCall | ToolCallError:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        return ToolCallError(f"tool call is not valid JSON ({err.msg} at character {err.pos})", raw=raw)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCallError('tool call must be a JSON object {"name": "...", "arguments": {...}}', raw=raw)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(f"arguments of {value['name']!r} are a string that is not a JSON object", raw=raw)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f"arguments of {value['name']!r} must be a JSON object", raw=raw)
    return ToolCall(value["name"], arguments)
