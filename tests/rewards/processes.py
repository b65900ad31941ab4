"""What a run's reward leaves running, read from the process table (psutil): its reward worker processes and the
judge servers vlmrl launched. A closed run, or a failed setup, must leave none of either."""

from __future__ import annotations

import textwrap
from pathlib import Path

import psutil

BROKEN_TOOL = """
    from vlmrl.agent.tools import Tool

    class Sandbox(Tool):
        name = "sandbox"

        def __init__(self):
            raise ConnectionError("the sandbox service does not answer")
"""
"""A tool whose constructor fails: the agent loop, the last part a run's setup starts, cannot start (a setup that
fails after the reward has started its processes)."""


def broken_tool(folder: Path, response_length: int) -> list[str]:
    """The overrides of a multi-turn run with BROKEN_TOOL (written into `folder`) in responses of
    `response_length` tokens (data.max_response_length)."""
    path = folder / "sandbox_tool.py"
    path.write_text(textwrap.dedent(BROKEN_TOOL))
    return ["agent.enable=true", f"agent.tools=[{{path: '{path}:Sandbox'}}]",
            f"agent.max_response_tokens={response_length}", "agent.max_tool_images=0"]


def running_children(marker: str) -> set[int]:
    """The pids of this process's descendants that run (zombies left out) with `marker` in their command line."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and marker in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:  # ended while we looked
            pass
    return found


def reward_workers() -> set[int]:
    """Reward worker processes (`python -c "... from vlmrl.rewards.workers import serve ..."`)."""
    return running_children("vlmrl.rewards.workers")


def judge_servers() -> set[int]:
    """SGLang judge servers vlmrl launched (`python -m sglang.launch_server`)."""
    return running_children("sglang.launch_server")
