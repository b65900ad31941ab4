"""Agent trajectories against the chat template's rendering of their final conversation (vlmrl.alignment.
trajectory_check): the loop's ids agree on the scripted conversations (tool calls, tool images, both tool turn
formats); each way of building them otherwise is named; `compare --gate trajectory` runs it on an engine."""

from __future__ import annotations

import json

import pytest

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, P, R
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolRegistry
from vlmrl.alignment.trajectory_check import check_trajectory


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    from vlmrl.processors.loading import load_processor

    return load_processor(tiny_model_path)


def _rows():
    return [scripted.row(scripted.LONG_QUESTION), scripted.row(scripted.SHORT_QUESTION)]


def _run(processor, backend, tool_turn_format="qwen2.5"):
    config = AgentConfig(tool_turn_format=tool_turn_format)
    requests = [processor.build_request(row, i) for i, row in enumerate(_rows())]
    with AgentLoop(backend, processor, config, prompt_length=P, response_length=R,
                   tools=ToolRegistry([EchoTool(), ImageZoomTool()])) as loop:
        return requests, loop.run(requests, GREEDY)


def _check(processor, request, sample, tool_turn_format="qwen2.5", **changes):
    fields = {"turn_ids": sample.turn_ids, "turn_mask": sample.turn_mask, "tool_turns": sample.tool_turns, **changes}
    return check_trajectory(processor, processor.prompt_messages(_rows()[request.index], request.index),
                            request.prompt_ids, fields["turn_ids"], fields["turn_mask"], fields["tool_turns"],
                            tool_turn_format, index=request.index, sample_index=sample.sample_index)


@pytest.fixture(scope="module")
def scripted_run(tiny_model_path, processor):
    from tests.fakes import ScriptedBackend

    with ScriptedBackend(tiny_model_path, scripted.ScriptedModel(processor), max_model_len=1024) as backend:
        yield _run(processor, backend)


def test_the_loops_ids_are_the_templates_rendering_of_the_conversation(scripted_run, processor):
    requests, batch = scripted_run
    long = batch.samples[0]
    assert long.num_turns == 3 and len(long.tool_turns) == 2 and any(count for _, count in long.tool_turns[1])
    for k, sample in enumerate(batch.samples):
        assert _check(processor, requests[k // 2], sample) is None


def test_each_way_of_building_other_ids_is_named(scripted_run, processor):
    requests, batch = scripted_run
    request, sample = requests[0], batch.samples[0]
    tokenizer = processor.tokenizer
    # an assistant turn tokenized otherwise than its text: the first word's token split into its characters
    first = sample.turn_ids[0]
    pieces = tokenizer.encode(tokenizer.decode([first])[0], add_special_tokens=False)
    rest = tokenizer.encode(tokenizer.decode([first])[1:], add_special_tokens=False)
    assert len(pieces + rest) > 1, "the first generated token must be splittable"
    split_ids = pieces + rest + sample.turn_ids[1:]
    split_mask = [1] * (len(pieces) + len(rest)) + sample.turn_mask[1:]
    found = _check(processor, request, sample, turn_ids=split_ids, turn_mask=split_mask)
    assert found.kind == "assistant_text" and found.position == len(request.prompt_ids), found.line()
    assert found.same_text and "same text, other tokens" in found.line()
    # a tool turn whose recorded text is not what its ids hold (the loop rendered the tool output otherwise)
    tools = [[[text + " (cut)", count] for text, count in turn] for turn in sample.tool_turns]
    found = _check(processor, request, sample, tool_turns=tools)
    assert found.kind == "non_assistant_text" and sample.turn_mask[found.position - len(request.prompt_ids)] == 0
    # turns joined without the template's <|im_start|>: the first tool turn's opening token dropped
    start = sample.turn_mask.index(0)
    opening = next(i for i in range(start, len(sample.turn_ids)) if sample.turn_ids[i] ==
                   tokenizer.convert_tokens_to_ids("<|im_start|>"))
    ids = sample.turn_ids[:opening] + sample.turn_ids[opening + 1:]
    mask = sample.turn_mask[:opening] + sample.turn_mask[opening + 1:]
    found = _check(processor, request, sample, turn_ids=ids, turn_mask=mask)
    assert found.kind == "special_tokens" and "<|im_start|>" in found.rendered, found.line()
    # whitespace only: a newline dropped after a tool response is reported, and said to be whitespace
    newline = tokenizer.encode("\n", add_special_tokens=False)
    at = next(i for i in range(start, len(sample.turn_ids)) if [sample.turn_ids[i]] == newline and
              sample.turn_mask[i] == 0)
    found = _check(processor, request, sample, turn_ids=sample.turn_ids[:at] + sample.turn_ids[at + 1:],
                   turn_mask=sample.turn_mask[:at] + sample.turn_mask[at + 1:])
    assert found is not None and found.strippable and "whitespace only" in found.line()


@pytest.mark.slow
def test_the_trajectory_gate_runs_the_agent_on_an_engine(tmp_path, tiny_model_path, capsys):
    """`compare --gate trajectory` with the agent section of the agent runs, on the HF backend on the taught model:
    every trajectory agrees, tool turns were taken; without agent.enable it exits 2 saying what to set."""
    from tests.agent.training import teach_model, write_run_files
    from vlmrl.alignment.compare import main

    class Factory:
        def mktemp(self, name):
            folder = tmp_path / name
            folder.mkdir()
            return folder

    taught = teach_model(tiny_model_path, Factory())
    data, reward, agent_yaml = write_run_files(tmp_path)
    common = [f"actor.model_path={taught}", f"data.train_files={data}", f"data.val_files={data}",
              "data.max_prompt_length=96", "data.max_response_length=256", "data.max_pixels=12544",
              f"reward.function={reward}:compute_score", "rollout.n=2", "rollout.temperature=0.05",
              "rollout.name=hf", f"trainer.output_dir={tmp_path / 'out'}"]
    out = tmp_path / "gate"
    assert main(["--gate", "trajectory", f"config={agent_yaml}", *common, "--out", str(out)]) == 0
    report = json.loads((out / "gates.json").read_text())
    gate = report["gates"][0]
    assert gate["name"] == "trajectory" and gate["ok"] and gate["checked"] == 4
    assert int(gate["note"].split()[0]) >= 4, gate["note"]
    assert main(["--gate", "trajectory", *common, "--out", str(out)]) == 2
    assert "set agent.enable=true" in capsys.readouterr().err


def test_template_tool_turns_agree_too(tiny_model_path, processor):
    """agent.tool_turn_format=template (the chat template's own tool role) is rendered the same way."""
    from tests.fakes import ScriptedBackend

    with ScriptedBackend(tiny_model_path, scripted.ScriptedModel(processor), max_model_len=1024) as backend:
        requests, batch = _run(processor, backend, "template")
    checked = [_check(processor, requests[k // 2], s, "template") for k, s in enumerate(batch.samples)]
    assert any(s.tool_turns for s in batch.samples)
    assert checked == [None] * len(batch.samples), [c.line() for c in checked if c]
