"""The weights probe's judgement on hand-built probes (`vlmrl.alignment.weight_probe.judge`), its files, and what the
drift tool makes of a failed probe. The probe on real engines: tests/rollout/helpers.py (every engine's contract) and
tests/trainer/test_drift_fit.py (real runs)."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from tests.alignment.test_drift import quiet_then, record, write_run
from vlmrl.alignment.drift import analyse, main
from vlmrl.alignment.drift_artifact import drop_steps_after
from vlmrl.alignment.weight_probe import (
    DIFFERS,
    FLOAT32_NOISE,
    IN_SYNC,
    PARTIAL,
    STALE,
    ProbeError,
    ProbeState,
    judge,
    probe_path,
    read_probes,
    write_probe,
)

TOKENS = [11, 12, 13, 14]
BASE = [-1.0, -2.0, -0.5, -3.0]
MOVE = [0.01, -0.02, 0.015, 0.005]
"""The trainer's movement between two probes: 0.02 nats at most, far above float32 noise."""


def moved(by: float, size: float = 1.0) -> list[float]:
    return [b + by * size * m for b, m in zip(BASE, MOVE)]


def first(gap: float = 1e-6):
    return judge(0, 0, TOKENS, [b + gap for b in BASE], BASE, 1e-3, noise_floor=FLOAT32_NOISE)


def again(engine_share: float, *, extra_gap: float = 0.0, reference=None, tokens=TOKENS, size: float = 1.0):
    """The next probe: the trainer moved by `size` x MOVE, the engine by `engine_share` of it (plus `extra_gap` on
    token 0)."""
    engine = moved(engine_share, size)
    engine[0] += extra_gap
    return judge(1, 1, tokens, engine, moved(1.0, size), 1e-3, reference or first(), FLOAT32_NOISE)


def test_a_sync_that_landed_is_in_sync_with_a_landed_fraction_of_one():
    record = again(1.0)
    assert record.verdict == IN_SYNC and record.resolved and record.landed_fraction == pytest.approx(1.0, abs=1e-3)
    assert record.reference_step == 0 and record.compared_tokens == 4 and record.trainer_moved == pytest.approx(0.02)


def test_an_engine_that_did_not_move_is_stale_though_its_gap_is_within_tolerance():
    record = again(0.0, size=0.02)  # the trainer moved 4e-4 nats: 100x the float32 noise floor
    assert record.max_abs_dlogp < 1e-3, "the gap alone would pass"
    assert record.verdict == STALE and record.landed_fraction == pytest.approx(0.0, abs=1e-3)
    assert "the sync did not land" in record.explanation


def test_half_an_update_is_partial():
    record = again(0.5)
    assert record.verdict == PARTIAL and record.landed_fraction == pytest.approx(0.5, abs=0.01)
    assert "landed partly" in record.explanation


def test_an_engine_that_moved_as_far_as_the_trainer_but_against_it_is_partial_not_stale():
    """Half a model's layers synced can move a small model's probe as far as the trainer moved it, the other way
    (measured on the tiny GLM-4.1V: landed fraction -0.72, the engine 0.05 nats against the trainer's 0.07): the
    sync landed partly; stale is an engine that stayed where it was."""
    record = again(-0.75)
    assert record.landed_fraction == pytest.approx(-0.75, abs=0.01)
    assert record.verdict == PARTIAL and "landed partly" in record.explanation


def test_a_landed_fraction_near_one_with_one_token_far_off_is_partial():
    """Most of the update landed, but one token sits 5e-4 nats off, within the tolerance but 125x the noise: part of
    the model missed it."""
    record = again(1.0, extra_gap=5e-4)
    assert 0.75 <= record.landed_fraction <= 1.33 and record.verdict == PARTIAL
    assert "125x" in record.explanation


def test_a_first_probe_beyond_the_tolerance_differs():
    record = first(gap=0.01)
    assert record.verdict == DIFFERS and record.reference_step is None and record.landed_fraction is None
    assert "beyond the 0.001-nat tolerance" in record.explanation


def test_an_update_below_the_resolution_is_in_sync_and_says_it_is_not_judged():
    """The trainer moved 2e-5 nats, less than 10x the float32 noise floor: what landed is not judged, and the record
    says a sync that did not land would look the same."""
    tiny = judge(1, 1, TOKENS, BASE, [b + 0.001 * m for b, m in zip(BASE, MOVE)], 1e-3, first(), FLOAT32_NOISE)
    assert tiny.verdict == IN_SYNC and not tiny.resolved and tiny.landed_fraction is None
    assert "a sync that did not land would look the same" in tiny.explanation


def test_greedy_tokens_that_changed_leave_nothing_to_compare():
    record = again(1.0, tokens=[99, 12, 13, 14])
    assert record.compared_tokens == 0 and record.verdict == IN_SYNC and "not measured" in record.explanation


def test_a_lucky_first_probe_does_not_make_normal_float32_noise_look_off():
    """A first probe exactly equal to the trainer (gap 0) is below the float32 floor: a later in-sync probe 3e-6
    off is still in sync."""
    record = again(1.0, extra_gap=3e-6, reference=first(gap=0.0))
    assert record.verdict == IN_SYNC and record.noise >= FLOAT32_NOISE


def test_the_state_judges_from_the_last_probe_in_sync_and_a_checkpoint_of_it_judges_alike():
    """After a stale probe the reference stays the last one in sync, so the sync that catches up is judged whole
    (f ~ 1 over two updates); a state loaded from state_dict judges the next probe exactly as the original."""
    state = ProbeState(FLOAT32_NOISE)
    assert state.judge(0, 0, TOKENS, BASE, BASE, 1e-3).verdict == IN_SYNC
    assert state.judge(1, 1, TOKENS, BASE, moved(1.0), 1e-3).verdict == STALE
    assert state.reference.step == 0
    copy = ProbeState(FLOAT32_NOISE)
    copy.load_state_dict(json.loads(json.dumps(state.state_dict())))  # as trainer_state.json holds it
    caught_up = state.judge(2, 2, TOKENS, moved(2.0), moved(2.0), 1e-3)
    assert caught_up.reference_step == 0 and caught_up.verdict == IN_SYNC
    assert caught_up.landed_fraction == pytest.approx(1.0, abs=1e-3)
    assert copy.judge(2, 2, TOKENS, moved(2.0), moved(2.0), 1e-3) == caught_up
    assert state.reference.step == 2


def test_uneven_tokens_and_logprobs_are_refused():
    with pytest.raises(ValueError, match="4 tokens, 3 engine and 4 trainer logprobs"):
        judge(0, 0, TOKENS, BASE[:3], BASE, 1e-3)


# ---------------------------------------------------------------------------------------------------- files


def test_probes_round_trip_and_a_resume_drops_the_later_ones(tmp_path):
    state = ProbeState(FLOAT32_NOISE)
    written = [state.judge(step, step, TOKENS, moved(step), moved(step), 1e-3) for step in range(4)]
    for probe in written:
        write_probe(tmp_path, probe)
    assert read_probes(tmp_path) == written
    assert read_probes(tmp_path, upto=1) == written[:2]
    drop_steps_after(tmp_path, 2)
    assert [p.step for p in read_probes(tmp_path)] == [0, 1, 2]


@pytest.mark.parametrize(("content", "says"), [("{not json", "not a readable probe record"),
                                              ('{"kind": "other"}', "not a vlmrl weight probe record"),
                                              ('{"kind": "vlmrl.weight_probe", "format_version": 1}', "missing")])
def test_a_corrupt_probe_file_is_refused_naming_it_and_the_drift_tool_exits_2(tmp_path, capsys, content, says):
    write_run(tmp_path, quiet_then([record(6, 1e-6)]))
    path = probe_path(tmp_path, 3)
    path.write_text(content)
    with pytest.raises(ProbeError, match=says):
        read_probes(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert str(path) in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- the drift tool


def _partial_probe_history(tmp_path, failed_step: int) -> None:
    """Probes after every sync of a 7-step run, in sync but for the one after `failed_step` (half of it landed)."""
    state = ProbeState(FLOAT32_NOISE)
    for step in range(8):
        share = 0.5 if step == failed_step else 1.0
        write_probe(tmp_path, state.judge(step, step, TOKENS, moved(max(step - 1 + share, 0)), moved(step), 1e-3))


class _FailedProbes(HTMLParser):
    def __init__(self):
        super().__init__()
        self.steps, self.verdicts, self._in_verdict = [], [], False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "failed-probe" in (a.get("class") or ""):
            self.steps.append(int(a["data-probe-step"]))
        self._in_verdict = tag == "td" and "probe-verdict" in (a.get("class") or "")

    def handle_data(self, data):
        if self._in_verdict:
            self.verdicts.append(data)
            self._in_verdict = False


def test_a_jump_after_a_failed_probe_is_put_down_to_the_weights_though_the_versions_agree(tmp_path, capsys):
    """Step 6's samples are off with the engine on the trainer's step (the load count saw the sync): the probe
    after step 5's sync found half of it landed, so the cause is weights, through the probe."""
    write_run(tmp_path, quiet_then([record(6, 0.3), record(6, 0.2, row=1, modality="text")]))
    _partial_probe_history(tmp_path, failed_step=5)
    report = analyse(tmp_path)
    assert [s.step for s in report.jumps] == [6] and [p.step for p in report.failed_probes] == [5]
    worst = report.jumps[0].worst
    assert {w.cause for w in worst} == {"weights"}
    assert all("weights probe after step 5's sync: partial" in w.explanation for w in worst)
    assert report.steps[4].probe_verdict == PARTIAL and report.steps[5].probe_verdict == IN_SYNC

    assert main([str(tmp_path), "--out", str(tmp_path / "report")]) == 1
    assert "weight probe after step 5's sync: partial" in capsys.readouterr().out
    dom = _FailedProbes()
    dom.feed((tmp_path / "report" / "drift.html").read_text())
    assert dom.steps == [5] and dom.verdicts == [PARTIAL]
    saved = json.loads((tmp_path / "report" / "drift.json").read_text())
    assert [p["step"] for p in saved["failed_probes"]] == [5] and saved["failed_probes"][0]["verdict"] == PARTIAL


def test_a_failed_probe_without_a_jump_still_exits_1(tmp_path, capsys):
    write_run(tmp_path, {s: [record(s, 1e-6)] for s in range(1, 8)})
    _partial_probe_history(tmp_path, failed_step=3)
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "0 jump(s)" in out and "weight probe after step 3's sync: partial" in out
