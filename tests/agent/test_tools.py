"""Tools: timeouts for plain and async methods, building from config paths, the system prompt, the built-in tools."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading

import pytest
from PIL import Image

from vlmrl.agent.builtin import Geo3kAnswerTool, ImageZoomTool
from vlmrl.agent.config import ToolSpec
from vlmrl.agent.tools import Tool, ToolContext, ToolOutput, ToolRegistry, ToolTimeout, as_output, call_tool_method
from vlmrl.types import RolloutRequest


def test_plain_and_async_methods_run_under_a_timeout():
    release = threading.Event()

    def blocking():
        release.wait(30)

    async def hanging():
        await asyncio.Event().wait()

    async def main():
        assert await call_tool_method(lambda x: x + 1, 1, timeout_s=5, executor=None) == 2
        try:
            for method in (blocking, hanging):
                with pytest.raises(ToolTimeout, match="timed out after 0.2 s"):
                    await call_tool_method(method, timeout_s=0.2, executor=None)
        finally:
            release.set()  # before asyncio.run waits for its default executor's threads

    asyncio.run(main())


def test_lifecycle_methods_a_tool_does_not_override_never_wait_on_the_tool_threads():
    """A tool that overrides only async methods runs entirely on the event loop, so the turns are batched in the same
    order in every run (a resumed run's step equals the uninterrupted one): the defaults must not hop to a thread."""

    class NoThreads(concurrent.futures.Executor):
        def submit(self, fn, *args, **kwargs):
            raise AssertionError(f"{fn} was sent to the tool threads")

    class PlainRelease(Tool):
        name = "plain_release"

        def release(self, state):  # a plain override still runs in the tool threads
            return "released"

    tool, no_threads = PlainRelease(), NoThreads()

    async def main():
        assert await call_tool_method(tool.create, None, timeout_s=5, executor=no_threads) is None
        assert await call_tool_method(tool.reward, None, timeout_s=5, executor=no_threads) is None
        with pytest.raises(AssertionError, match="sent to the tool threads"):
            await call_tool_method(tool.release, None, timeout_s=5, executor=no_threads)

    asyncio.run(main())


def test_return_values():
    assert as_output("x") == ToolOutput(text="x") and as_output(None) == ToolOutput()
    with pytest.raises(TypeError, match="must return a ToolOutput or a str"):
        as_output(3)
    with pytest.raises(TypeError, match="must be PIL images"):
        as_output(ToolOutput(images=["not an image"]))


def test_registry_from_specs(tmp_path):
    user_file = tmp_path / "my_tools.py"
    user_file.write_text("from vlmrl.agent.tools import Tool\nclass Hello(Tool):\n    name = 'hello'\n"
                         "    def __init__(self, greeting='hi'):\n        self.greeting = greeting\n")
    registry = ToolRegistry.from_specs([
        ToolSpec(path="vlmrl.agent.builtin:ImageZoomTool", name="crop", kwargs={"min_side": 8}),
        ToolSpec(path=f"{user_file}:Hello", kwargs={"greeting": "yo"}),
    ])
    assert registry.names == ["crop", "hello"] and registry.get("hello").greeting == "yo"
    prompt = registry.system_prompt()
    schemas = [json.loads(line) for line in prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
    assert [s["function"]["name"] for s in schemas] == ["crop", "hello"]
    assert "<tool_call>" in prompt
    with pytest.raises(ValueError, match=r"agent.tools\[0\] \('vlmrl.agent.builtin:Nope'\)"):
        ToolRegistry.from_specs([ToolSpec(path="vlmrl.agent.builtin:Nope")])
    with pytest.raises(ValueError, match="not a vlmrl.agent.tools.Tool"):
        ToolRegistry.from_specs([ToolSpec(path="vlmrl.agent.tools:ToolOutput")])
    with pytest.raises(ValueError, match="two tools are named 'a'"):
        ToolRegistry([type("A", (Tool,), {"name": "a"})(), type("B", (Tool,), {"name": "a"})()])


def _context(images=(), ground_truth=None):
    return ToolContext(RolloutRequest(uid="u", prompt_ids=[1], images=list(images), ground_truth=ground_truth), 0)


def test_zoom_crops_the_prompt_image():
    image = Image.new("RGB", (112, 56), "white")
    image.paste((255, 0, 0), (56, 0, 112, 56))
    tool = ImageZoomTool()
    state = tool.create(_context([image]))
    out = tool.execute(state, {"box": [60, 10, 100.4, 50]})
    assert out.images[0].size == (40, 40) and out.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert out.text == "Zoomed into [60, 10, 100, 50] of image 0."
    assert tool.execute(state, {"box": [-10, -10, 500, 500]}).images[0].size == (112, 56)  # clipped to the image
    for bad, message in (({"box": [0, 0, 2, 2]}, "less than 4 pixels"), ({"box": "all"}, "box must be"),
                         ({"box": [0, 0, 9, 9], "image": 1}, "image must be an integer in")):
        with pytest.raises(ValueError, match=message):
            tool.execute(state, bad)


def test_geo3k_answer_tool_rewards_the_last_checked_answer():
    tool = Geo3kAnswerTool()
    state = tool.create(_context(ground_truth="2\\sqrt{3}"))
    assert tool.reward(state) == 0.0
    assert tool.execute(state, {"answer": "2 \\sqrt{3}"}) == "The answer 2 \\sqrt{3} is correct."
    assert tool.reward(state) == 1.0
    assert tool.execute(state, {"answer": "4"}) == "The answer 4 is not correct."
    assert tool.reward(state) == 0.0
    with pytest.raises(ValueError, match="arguments must be"):
        tool.execute(state, {"ans": "4"})
    # model output reaches sympy in the trainer's process: ** towers (9**9**8 ran 90 s holding the GIL) and long
    # expressions are refused before grading
    for hostile in ("9**9**7", "1+" * 40 + "1"):
        with pytest.raises(ValueError, match=r"at most 64 characters, with \^ for powers"):
            tool.execute(state, {"answer": hostile})
    assert tool.reward(state) == 0.0 and len(state.scores) == 2
