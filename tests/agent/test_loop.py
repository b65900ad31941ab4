"""The agent loop: multi-turn trajectories with a text tool and an image tool, tool failures, limits.

The first test runs the HF backend on the tiny model taught the scripted conversations (tests/agent/scripted.py), so
that the trainer's forward can be checked against real rollout logprobs. The others test the loop's logic and play
the same conversations on the scripted backend (the taught model's tokens, no model).
"""

from __future__ import annotations

import pytest

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, HangingZoomTool, Lifecycle, P, R, check_long_sample, tool_turn_texts
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import Tool, ToolRegistry
from vlmrl.types import SamplingParams


def make_loop(backend, processor, tools, **config) -> AgentLoop:
    return AgentLoop(backend, processor, AgentConfig(**config), prompt_length=P, response_length=R,
                     tools=ToolRegistry(tools))


def test_text_and_image_tools_match_the_processor_on_the_whole_conversation(backend, processor, hf_model):
    log = Lifecycle()
    with make_loop(backend, processor, [EchoTool(log), ImageZoomTool()]) as loop:
        batch = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION)),
                          processor.build_request(scripted.row(scripted.SHORT_QUESTION))], GREEDY, policy_version=3)
    assert len(batch.samples) == 4 and [s.sample_index for s in batch.samples] == [0, 1, 0, 1]
    long_samples, short_samples = batch.samples[:2], batch.samples[2:]
    for agent_sample in long_samples:
        assert agent_sample.num_turns == 3 and agent_sample.end_reason == "no_tool_call"
        assert agent_sample.assistant_texts[-1] == scripted.FINAL_ANSWER
        check_long_sample(agent_sample, processor, hf_model)
        versions = agent_sample.token_versions
        mask = agent_sample.sample.response_mask.bool()
        assert set(versions[mask].tolist()) == {3} and agent_sample.sample.policy_version == 3
        assert set(versions[~mask].tolist()) == {-1, -2}  # tool turns, padding
        assert agent_sample.sample.reward_extra["tool/echo"] == 0.5
    for agent_sample in short_samples:
        assert agent_sample.num_turns == 1 and agent_sample.assistant_texts == [scripted.SHORT_ANSWER]
        assert agent_sample.sample.multi_modal_inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
        assert float(agent_sample.sample.response_mask.sum()) == 2  # "7" and <|im_end|>
    # per trajectory: create, execute, reward, release, once each and in that order (SHORT never calls echo)
    assert sorted(log.events.values()) == [["create", "execute", "reward", "release"]] * 2 + [
        ["create", "reward", "release"]] * 2
    assert batch.metrics["agent/turns/max"] == 3 and batch.metrics["agent/tool/images/mean"] == 0.5
    # every turn went to the backend once (2 first turns + 2 x 2 later LONG turns), and concurrent turns shared calls:
    # the first turns of both groups go together; later turns pair up unless the threaded tools finish far apart
    calls = batch.metrics["agent/generate_calls"]
    assert calls * batch.metrics["agent/requests_per_call/mean"] == 6 and 3 <= calls <= 5


@pytest.mark.parametrize("case", ["raise", "sync-timeout", "async-timeout", "create-fails"])
def test_a_failing_tool_becomes_an_error_message(scripted_backend, processor, case):
    echo = EchoTool(mode={"raise": "raise", "sync-timeout": "block"}.get(case, "ok"))
    zoom = HangingZoomTool() if case == "async-timeout" else ImageZoomTool()
    if case == "create-fails":
        def broken_create(context):
            raise OSError("no sandbox")
        echo.create = broken_create
    try:
        with make_loop(scripted_backend, processor, [echo, zoom], tool_timeout_s=0.5) as loop:
            batch = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))],
                             SamplingParams(n=1, temperature=0.0, max_new_tokens=64))
    finally:
        echo.unblock.set()
    (agent_sample,) = batch.samples
    replies = tool_turn_texts(agent_sample, processor.tokenizer)
    expected, counter = {
        "raise": ("Error: tool 'echo' failed: RuntimeError: echo is broken", "tool/errors"),
        "sync-timeout": ("Error: tool 'echo' timed out after 0.5 s.", "tool/timeouts"),
        "async-timeout": ("Error: tool 'zoom' timed out after 0.5 s.", "tool/timeouts"),
        "create-fails": ("Error: tool 'echo' is unavailable: it failed to start (OSError: no sandbox)", "tool/errors"),
    }[case]
    assert any(expected in reply for reply in replies), replies
    assert agent_sample.counters[counter] == 1
    # the step went on: the model answered the error with more turns (a longer error reply can use up the response
    # budget before the answer)
    assert agent_sample.num_turns >= 2 and agent_sample.sample.finish_reason in ("stop", "length")
    assert batch.metrics[f"agent/{counter}/mean"] == 1


def test_limits_end_the_trajectory(scripted_backend, processor):
    backend = scripted_backend
    request = processor.build_request(scripted.row(scripted.LONG_QUESTION))
    one = SamplingParams(n=1, temperature=0.0, max_new_tokens=64)
    with make_loop(backend, processor, [EchoTool(), ImageZoomTool()], max_turns=2) as loop:
        (turns,) = loop.run([request], one).samples
    assert (turns.num_turns, turns.end_reason, turns.sample.finish_reason) == (2, "max_turns", "stop")
    assert "tool/zoom/calls" not in turns.counters  # the last turn's call is not executed: nothing could read it
    assert turns.sample.multi_modal_inputs["image_grid_thw"].shape[0] == 1

    with make_loop(backend, processor, [EchoTool(), ImageZoomTool()], max_response_tokens=40) as loop:
        (budget,) = loop.run([request], one).samples
    # turn 1 (26 tokens) fits; its 17-token reply would not leave room for another token
    assert (budget.end_reason, budget.sample.finish_reason) == ("max_response_tokens", "length")
    assert int(budget.sample.attention_mask[P:].sum()) <= 40

    with make_loop(backend, processor, [EchoTool(), ImageZoomTool()], max_turn_tokens=10) as loop:
        (turn_cap,) = loop.run([request], one).samples
    assert (turn_cap.end_reason, turn_cap.sample.finish_reason) == ("max_turn_tokens", "length")
    assert int(turn_cap.sample.response_mask.sum()) == 10


class _Broken(Tool):
    name = "broken"

    def execute(self, state, arguments):
        return 42  # not a ToolOutput or str


def test_unknown_tools_and_bad_return_values_are_reported_to_the_model(scripted_backend, processor):
    with make_loop(scripted_backend, processor, [_Broken(), ImageZoomTool()]) as loop:
        (agent_sample,) = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))],
                                   SamplingParams(n=1, temperature=0.0, max_new_tokens=64)).samples
    first_reply = tool_turn_texts(agent_sample, processor.tokenizer)[0]
    assert "Error: there is no tool named 'echo'; available: broken, zoom." in first_reply
    assert agent_sample.counters["tool/unknown_tool"] == 1


def test_a_rollout_that_fails_mid_conversation_releases_every_tool_state(tiny_model_path, processor):
    """The backend refuses the conversation once the zoom tool's image takes it over its image limit (the check every
    backend runs, raised on the third turn): run() raises it, and every started trajectory's tool state (a sandbox,
    a connection) is released on the way out."""
    from tests.fakes import ScriptedBackend
    from vlmrl.rollout.errors import InvalidRequestError

    log = Lifecycle()
    with ScriptedBackend(tiny_model_path, scripted.ScriptedModel(processor), max_model_len=1024,
                         limit_images=1) as strict, \
            make_loop(strict, processor, [EchoTool(log), ImageZoomTool()]) as loop:
        with pytest.raises(InvalidRequestError, match="images"):
            loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))], GREEDY)
        assert len(log.events) == 2 and all(events[0] == "create" for events in log.events.values())
        assert all(events.count("release") == 1 for events in log.events.values()), dict(log.events)
    assert all(events.count("release") == 1 for events in log.events.values()), "released twice on close"
