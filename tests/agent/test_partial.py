"""Partial rollout on the scripted backend (the taught model's tokens, tests/agent/scripted.py): a full batch returns
while long groups are unfinished; carried groups finish in the next step with each token tagged by the policy version
that generated it; drop and staleness limits release."""

from __future__ import annotations

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, Lifecycle, P, R, full_ids, requests
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig, PartialRolloutConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolRegistry
from vlmrl.agent.trajectory import TOOL_VERSION


def make_loop(backend, processor, log: Lifecycle, **partial) -> AgentLoop:
    config = AgentConfig(partial=PartialRolloutConfig(enable=True, oversample_factor=2.0, **partial))
    return AgentLoop(backend, processor, config, prompt_length=P, response_length=R,
                     tools=ToolRegistry([EchoTool(log), ImageZoomTool()]))


def test_carried_groups_finish_next_step_with_their_version_tags(scripted_backend, processor):
    backend = scripted_backend
    log = Lifecycle()
    with make_loop(backend, processor, log, unfinished="carry") as loop:
        assert loop.prompts_needed(2) == 4
        new = requests(processor, scripted.SHORT_QUESTION, scripted.SHORT_QUESTION, scripted.LONG_QUESTION,
                       scripted.LONG_QUESTION)
        first = loop.step(new, GREEDY, batch_size=2, policy_version=0)
        # a full batch (the two short groups) while the long groups are still mid-conversation
        assert [r.uid for r in first.requests] == [new[0].uid, new[1].uid] or \
               [r.uid for r in first.requests] == [new[1].uid, new[0].uid]
        assert len(first.samples) == 4
        carried = loop.carried
        assert sorted(g.request.uid for g in carried) == sorted([new[2].uid, new[3].uid])
        assert all(not t.done and t.turns >= 1 for g in carried for t in g.trajectories)
        assert first.metrics["partial/carried_groups"] == 2 and first.metrics["partial/stale_tokens"] == 0
        before = {t.key: list(t.token_versions) for g in carried for t in g.trajectories}
        assert all(set(v) <= {0, TOOL_VERSION} for v in before.values())

        assert loop.prompts_needed(2) == 2
        more = requests(processor, scripted.LONG_QUESTION, scripted.LONG_QUESTION)
        second = loop.step(more, GREEDY, batch_size=2, policy_version=1)
        # the carried groups were ahead: they finish first and fill the batch; the new ones are carried in turn
        assert sorted(r.uid for r in second.requests) == sorted([new[2].uid, new[3].uid])
        assert sorted(g.request.uid for g in loop.carried) == sorted(r.uid for r in more)
        for group in carried:
            for traj in group.trajectories:
                old = before[traj.key]
                assert traj.token_versions[: len(old)] == old  # tags of step-1 tokens kept
                assert set(traj.token_versions[len(old):]) <= {1, TOOL_VERSION}
                assert 1 in traj.token_versions[len(old):]
        stale = sum(v == 0 for tags in before.values() for v in tags)
        assert second.metrics["partial/stale_tokens"] == stale > 0
        assert second.metrics["partial/max_version_lag"] == 1
        assert second.metrics["partial/resumed_groups"] == 2 and second.metrics["partial/new_groups"] == 2
        for agent_sample in second.samples:
            assert agent_sample.sample.policy_version == 0  # the oldest policy that contributed
            assert agent_sample.num_turns == 3 and agent_sample.assistant_texts[-1] == scripted.FINAL_ANSWER
            assert set(agent_sample.token_versions[agent_sample.sample.response_mask.bool()].tolist()) == {0, 1}

        # parking changed nothing: the same conversation as an uninterrupted rollout
        reference = loop.run(requests(processor, scripted.LONG_QUESTION), GREEDY)
        assert full_ids(second.samples[0].sample).tolist() == full_ids(reference.samples[0].sample).tolist()
    # closing released the still-carried trajectories; every trajectory was created and released exactly once
    assert all(events[0] == "create" and events[-1] == "release" and events.count("release") == 1
               for events in log.events.values())
    assert len(log.events) == 2 * (4 + 2 + 1)


def test_drop_releases_unfinished_groups(scripted_backend, processor):
    backend = scripted_backend
    log = Lifecycle()
    with make_loop(backend, processor, log, unfinished="drop") as loop:
        new = requests(processor, scripted.SHORT_QUESTION, scripted.LONG_QUESTION, scripted.LONG_QUESTION)
        batch = loop.step(new, GREEDY, batch_size=1, policy_version=0)
        assert [r.uid for r in batch.requests] == [new[0].uid]
        assert loop.carried == [] and loop.prompts_needed(1) == 2
        assert batch.metrics["partial/dropped_groups"] == 2
    long_ids = {f"{r.uid}/{i}" for r in new[1:] for i in range(2)}
    for key in long_ids:  # dropped: released without a reward
        assert log.events[key][-1] == "release" and "reward" not in log.events[key]


def test_too_stale_groups_are_dropped_not_resumed(scripted_backend, processor):
    backend = scripted_backend
    log = Lifecycle()
    with make_loop(backend, processor, log, unfinished="carry", max_staleness=1) as loop:
        new = requests(processor, scripted.SHORT_QUESTION, scripted.LONG_QUESTION)
        loop.step(new, GREEDY, batch_size=1, policy_version=0)
        assert len(loop.carried) == 1
        batch = loop.step(requests(processor, scripted.SHORT_QUESTION), GREEDY, batch_size=1, policy_version=2)
        assert batch.metrics["partial/dropped_stale_groups"] == 1 and batch.metrics["partial/resumed_groups"] == 0
        assert batch.metrics["partial/stale_tokens"] == 0
    assert all("reward" not in log.events[f"{new[1].uid}/{i}"] for i in range(2))


def test_chunked_turns_give_the_same_conversation(scripted_backend, processor):
    backend = scripted_backend
    """A turn generated in 8-token pieces (so that it can be parked between them) equals one generated whole."""
    log = Lifecycle()
    with make_loop(backend, processor, log, chunk_tokens=8) as loop:
        request = requests(processor, scripted.LONG_QUESTION)
        chunked = loop.step(request, GREEDY, batch_size=1, policy_version=0)
    with AgentLoop(backend, processor, AgentConfig(), prompt_length=P, response_length=R,
                   tools=ToolRegistry([EchoTool(), ImageZoomTool()])) as plain:
        whole = plain.run(request, GREEDY)
    assert [full_ids(s.sample).tolist() for s in chunked.samples] == [full_ids(s.sample).tolist()
                                                                      for s in whole.samples]
    assert chunked.samples[0].num_turns == 3
    assert chunked.metrics["agent/generate_calls"] > whole.metrics["agent/generate_calls"]
