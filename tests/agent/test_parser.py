"""Tool-call parsing: well-formed Qwen2.5 calls, several per turn, and every malformed kind named for the model."""

from __future__ import annotations

import pytest

from vlmrl.agent.parser import ToolCall, ToolCallError, parse_tool_calls


def test_calls_in_order_with_surrounding_text():
    text = ('Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"box": [1, 2, 3, 4]}}\n</tool_call>\n'
            '<tool_call>{"name": "check_answer", "arguments": {"answer": "12"}}</tool_call><|im_end|>')
    assert parse_tool_calls(text) == [ToolCall("zoom", {"box": [1, 2, 3, 4]}),
                                      ToolCall("check_answer", {"answer": "12"})]


def test_arguments_written_as_a_json_string_or_left_out():
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>') == [
        ToolCall("a", {"x": 1})]
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>') == [ToolCall("a", {})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "a", "arguments": {"x": }}', "tool call is not valid JSON"),
    ('["a"]', 'tool call must be a JSON object {"name": "...", "arguments": {...}}'),
    ('{"arguments": {}}', 'tool call must be a JSON object'),
    ('{"name": "a", "arguments": [1]}', "arguments of 'a' must be a JSON object"),
    ('{"name": "a", "arguments": "not json"}', "arguments of 'a' are a string that is not a JSON object"),
])
def test_malformed_calls_become_errors(body, message):
    (error,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(error, ToolCallError) and error.message.startswith(message) and error.raw == body


def test_an_unclosed_call_after_good_ones_is_reported():
    calls = parse_tool_calls('<tool_call>{"name": "a"}</tool_call> and <tool_call>{"name": "b", "argu')
    assert calls[0] == ToolCall("a", {}) and isinstance(calls[1], ToolCallError)
    assert "not closed" in calls[1].message


def test_no_call():
    assert parse_tool_calls("The answer is \\boxed{3}.") == []
