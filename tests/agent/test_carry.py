"""Carried partial-rollout groups survive a checkpoint: saved by one loop, restored into a fresh one, they come back
equal (ids, logprobs, version tags, images, turn state, tool states, padded samples) and the next step gives what the
original loop gives when it simply goes on."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from tests.agent import scripted
from tests.agent.helpers import (GREEDY, P, R, AsyncZoom, CountingEcho, Lifecycle, assert_same_groups,
                                assert_same_sample, requests)
from vlmrl.agent import AgentConfig, AgentLoop, PartialRolloutConfig, ToolRegistry, Trajectory
from vlmrl.agent.builtin import Geo3kAnswerTool
from vlmrl.agent.carry import CARRIED_JSON, TRAJECTORY_FIELDS
from vlmrl.agent.tools import ToolContext


def make_loop(backend, processor, log: Lifecycle) -> AgentLoop:
    config = AgentConfig(partial=PartialRolloutConfig(enable=True, oversample_factor=2.0))
    return AgentLoop(backend, processor, config, prompt_length=P, response_length=R,
                     tools=ToolRegistry([CountingEcho(log), AsyncZoom()]))


def test_restored_groups_are_equal_and_the_next_step_matches_the_uninterrupted_loop(backend, processor, tmp_path):
    log, fresh_log = Lifecycle(), Lifecycle()
    with make_loop(backend, processor, log) as original:
        original.step(requests(processor, *[scripted.SHORT_QUESTION] * 2, *[scripted.LONG_QUESTION] * 2), GREEDY,
                      batch_size=2, policy_version=0)
        original.step(requests(processor, scripted.LONG_QUESTION, scripted.SHORT_QUESTION), GREEDY, batch_size=2,
                      policy_version=1)
        carried = original.carried
        # What this test relies on: a finished group waiting for a batch (padded again on load) and a group parked
        # mid-conversation after the zoom tool returned an image.
        assert any(g.done for g in carried)
        assert any(not t.done and t.tool_images and t.tool_states["echo"]["calls"] == 1
                   for g in carried for t in g.trajectories)
        assert original.save_carried(tmp_path) == len(carried)

        with make_loop(backend, processor, fresh_log) as resumed:
            assert resumed.restore_carried(tmp_path) == len(carried)
            assert_same_groups(resumed.carried, carried)
            assert resumed.prompts_needed(2) == original.prompts_needed(2)

            new = requests(processor, scripted.SHORT_QUESTION)
            expected = original.step(new, GREEDY, batch_size=2, policy_version=2)
            got = resumed.step(new, GREEDY, batch_size=2, policy_version=2)
            assert [r.uid for r in got.requests] == [r.uid for r in expected.requests]
            assert len(got.samples) == len(expected.samples) == 4
            for i, (a, b) in enumerate(zip(got.samples, expected.samples)):
                assert_same_sample(a, b, f"step 3 sample {i}")
            assert got.metrics == expected.metrics  # staleness, turns, tool counters, backend calls
            assert got.metrics["partial/resumed_groups"] == len(carried)
            assert got.metrics["partial/stale_tokens"] > 0  # tokens of versions 0 and 1 came through the checkpoint
            assert_same_groups(resumed.carried, original.carried)
    # The restored echo states were loaded, not created again; each trajectory still ends with one release.
    restored_keys = {t.key for g in carried for t in g.trajectories if not t.done}
    for key in restored_keys:
        assert fresh_log.events[key][0] == "load_state" and "create" not in fresh_log.events[key]
        assert fresh_log.events[key].count("release") == 1


def test_a_folder_without_carried_groups_loads_with_a_log_line(backend, processor, tmp_path, caplog):
    with make_loop(backend, processor, Lifecycle()) as loop, caplog.at_level(logging.WARNING, "vlmrl.agent.loop"):
        assert loop.restore_carried(tmp_path) is None
        assert loop.carried == [] and loop.prompts_needed(2) == 4
    assert "holds no carried partial-rollout groups" in caplog.text

    (tmp_path / CARRIED_JSON).write_text(json.dumps({"format": 99, "groups": []}))
    with make_loop(backend, processor, Lifecycle()) as loop, pytest.raises(ValueError, match="newer vlmrl"):
        loop.restore_carried(tmp_path)


def test_every_trajectory_field_is_saved():
    """A field added to Trajectory must be added to the checkpoint too (or stored apart, like these three)."""
    names = {f.name for f in dataclasses.fields(Trajectory)}
    assert names == set(TRAJECTORY_FIELDS) | {"request", "tool_images", "tool_states"}


def test_the_answer_tool_keeps_its_checked_answers(processor):
    tool = Geo3kAnswerTool()
    context = ToolContext(processor.build_request(scripted.row(scripted.SHORT_QUESTION)), 0)
    state = tool.create(context)
    tool.execute(state, {"answer": "7"})
    tool.execute(state, {"answer": "8"})
    restored = tool.load_state(context, json.loads(json.dumps(tool.save_state(state))))
    assert restored == state and tool.reward(restored) == 0.0
