"""The drift report on hand-built artifacts: the jump rule, the reader's errors, the causes, and the HTML (parsed)."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser

import pytest

from vlmrl.alignment.drift import JumpRule, analyse, find_jumps, main
from vlmrl.alignment.drift_artifact import DriftRecord, drop_steps_after, read_drift, step_path, write_step


def record(step: int, gap: float, *, row: int = 0, modality: str = "image", engine_version: int | None = None,
           tokens: int = 4) -> DriftRecord:
    """A sample whose trainer logprobs are `gap` nats above the engine's on every token."""
    engine = [-1.0 - 0.1 * i for i in range(tokens)]
    return DriftRecord(step=step, uid=f"u{step}-{row}", row=row, data_source="synthetic/colour", modality=modality,
                       engine_weight_version=step - 1 if engine_version is None else engine_version,
                       trainer_weight_version=step - 1, token_ids=list(range(tokens)), engine_logprobs=engine,
                       trainer_logprobs=[lp + gap for lp in engine])


def write_run(tmp_path, gaps: dict[int, list[DriftRecord]], metrics: list[dict] | None = None):
    for step, records in gaps.items():
        write_step(tmp_path, step, records)
    if metrics is not None:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))
    return tmp_path


# ---------------------------------------------------------------------------------------------------- the rule


def test_a_spike_over_a_quiet_float32_history_is_a_jump_and_the_step_after_is_not():
    values = [1e-12, 4e-12, 2e-12, 1e-12, 3e-12, 2e-4, 2e-12, 1e-12]
    assert find_jumps(values) == [5]


def test_bf16_noise_within_a_factor_of_a_few_is_never_a_jump():
    values = [1e-4, 3e-4, 1.5e-4, 0.8e-4, 2.5e-4, 1.2e-4, 4e-4, 0.9e-4]
    assert find_jumps(values) == []


def test_below_the_floor_nothing_jumps_however_far_it_moves():
    assert find_jumps([1e-14, 1e-14, 1e-14, 1e-14, 1e-11]) == []
    assert find_jumps([1e-14, 1e-14, 1e-14, 1e-14, 1e-11], JumpRule(floor=1e-12)) == [4]


def test_zero_gaps_read_as_float32_resolution_not_as_endless_spread():
    """Steps whose k3 is exactly 0 (identical logprobs) beside 1e-13 ones are one quiet level."""
    assert find_jumps([0.0, 1e-13, 0.0, 2e-13, 0.0, 1e-13]) == []
    assert find_jumps([0.0, 0.0, 0.0, 0.0, 5e-9]) == [4]


def test_no_step_is_judged_before_min_history_steps():
    assert find_jumps([1e-12, 1e-2, 1e-2]) == []
    assert find_jumps([1e-12, 1e-12, 1e-12, 1e-2], JumpRule(min_history=3)) == [3]


def test_a_lasting_shift_stops_being_a_jump_once_it_fills_half_the_window():
    values = [1e-12] * 6 + [1e-3] * 6
    jumps = find_jumps(values, JumpRule(window=6))
    assert jumps[0] == 6 and 8 <= jumps[-1] < 11, jumps


def test_a_nan_step_is_a_jump():
    assert find_jumps([1e-12, 1e-12, 1e-12, math.nan]) == [3]


# ---------------------------------------------------------------------------------------------------- reader


def test_the_reader_returns_every_step_in_order_and_a_resume_drops_later_steps(tmp_path):
    write_run(tmp_path, {s: [record(s, 1e-6), record(s, 1e-6, row=3)] for s in (1, 2, 3, 10)})
    assert [(r.step, r.row) for r in read_drift(tmp_path)] == [(1, 0), (1, 3), (2, 0), (2, 3), (3, 0), (3, 3),
                                                             (10, 0), (10, 3)]
    drop_steps_after(tmp_path, 2)
    assert sorted({r.step for r in read_drift(tmp_path)}) == [1, 2]


@pytest.mark.parametrize("content, says", [
    ("{not json\n", "not JSON"),
    (json.dumps({"kind": "vlmrl.validation"}) + "\n", "not a drift record"),
    (json.dumps({"kind": "vlmrl.drift", "format_version": 1, "step": 1}) + "\n", "missing"),
])
def test_a_corrupt_step_file_exits_2_with_one_line_naming_it(tmp_path, capsys, content, says):
    path = step_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and says in err


def test_a_run_without_drift_samples_exits_2_naming_the_folder(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert str(tmp_path / "drift") in capsys.readouterr().err


def test_uneven_token_and_logprob_lists_are_refused(tmp_path):
    bad = record(1, 0.0)
    bad.trainer_logprobs = bad.trainer_logprobs[:-1]
    write_step(tmp_path, 1, [bad])
    with pytest.raises(ValueError, match="4 tokens but 4 engine and 3 trainer logprobs"):
        read_drift(tmp_path)


# ---------------------------------------------------------------------------------------------------- causes


def quiet_then(step_records: list[DriftRecord], jump_step: int = 6) -> dict[int, list[DriftRecord]]:
    run = {s: [record(s, 1e-6, row=0), record(s, 2e-6, row=1, modality="text")] for s in range(1, jump_step)}
    run[jump_step] = step_records
    run[jump_step + 1] = [record(jump_step + 1, 1e-6)]
    return run


def test_stale_engine_weights_are_the_cause_weights(tmp_path):
    write_run(tmp_path, quiet_then([record(6, 0.3, engine_version=4), record(6, 0.2, row=1, modality="text",
                                                                             engine_version=4)]))
    report = analyse(tmp_path)
    assert [s.step for s in report.jumps] == [6] and report.series == "sampled k3"
    worst = report.jumps[0].worst
    assert [w.cause for w in worst] == ["weights", "weights"]
    assert "step 4's weights" in worst[0].explanation and "step 5's" in worst[0].explanation


def test_only_image_samples_off_is_the_cause_vision_inputs(tmp_path):
    write_run(tmp_path, quiet_then([record(6, 0.5), record(6, 1e-6, row=1, modality="text")]))
    worst = analyse(tmp_path).jumps[0].worst
    assert worst[0].cause == "vision_inputs" and worst[0].modality == "image"


def test_every_modality_off_on_current_weights_is_logprob_drift(tmp_path):
    write_run(tmp_path, quiet_then([record(6, 0.5), record(6, 0.4, row=1, modality="text")]))
    assert {w.cause for w in analyse(tmp_path).jumps[0].worst} == {"logprob_drift"}


def test_metrics_jsonl_k3_is_the_judged_series_when_every_step_has_it(tmp_path):
    """The kept samples look quiet at step 4, but the whole batch's mismatch/k3 jumped: the batch decides."""
    run = {s: [record(s, 1e-6)] for s in range(1, 7)}
    metrics = [{"step": s, "mismatch/k3": 1e-12 if s != 4 else 1e-3, "mismatch/ess": 1.0} for s in range(1, 7)]
    report = analyse(write_run(tmp_path, run, metrics))
    assert report.series == "mismatch/k3" and [s.step for s in report.jumps] == [4]
    assert report.steps[3].metrics["mismatch/k3"] == 1e-3


# ---------------------------------------------------------------------------------------------------- outputs


class _Dom(HTMLParser):
    """The elements a reader looks for: jump sections by step, cause cells, step rows, the inline plot; and every
    element closed where it was opened (a broken tag renders half the page inside another element)."""

    VOID = {"meta", "img", "br", "hr", "input", "link"}

    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.jump_sections, self.causes, self.step_rows, self.jump_rows, self.images = [], [], [], [], []
        self.verdict = ""
        self._in_verdict = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "section" and "jump-step" in classes:
            self.jump_sections.append(int(a["data-step"]))
        if tag == "td" and "cause" in classes:
            self.causes.append(a["data-cause"])
        if tag == "tr" and "data-step" in a:
            self.step_rows.append(int(a["data-step"]))
            if "jump" in classes:
                self.jump_rows.append(int(a["data-step"]))
        if tag == "img":
            self.images.append(a.get("src", ""))
        self._in_verdict = a.get("id") == "verdict"
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_data(self, data):
        if self._in_verdict:
            self.verdict += data

    def handle_endtag(self, tag):
        self._in_verdict = False
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()


def test_the_cli_writes_a_png_and_an_html_that_shows_the_jump_and_its_cause(tmp_path, capsys):
    run = write_run(tmp_path / "run", quiet_then([record(6, 0.3, engine_version=4)]))
    out = tmp_path / "report"
    assert main([str(run), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "step 6" in printed and "weights" in printed
    assert (out / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = _Dom()
    dom.feed((out / "drift.html").read_text())
    assert dom.open == [], f"unclosed: {dom.open}"
    assert dom.jump_sections == [6] and dom.causes == ["weights"] and dom.jump_rows == [6]
    assert dom.step_rows == list(range(1, 8)) and "1 jump" in dom.verdict
    assert len(dom.images) == 1 and dom.images[0].startswith("data:image/png;base64,")
    report = json.loads((out / "drift.json").read_text())
    assert report["jump_steps"] == [6]


def test_a_quiet_run_exits_0_and_its_html_says_no_jump(tmp_path):
    run = write_run(tmp_path, {s: [record(s, 1e-6)] for s in range(1, 9)})
    assert main([str(run)]) == 0
    dom = _Dom()
    dom.feed((run / "drift_report" / "drift.html").read_text())
    assert dom.jump_sections == [] and dom.verdict.strip() == "no jump"


def test_a_uid_is_data_and_cannot_become_markup(tmp_path):
    evil = record(6, 0.3, engine_version=4)
    evil.uid = "<script>alert(1)</script>"
    run = write_run(tmp_path, quiet_then([evil]))
    main([str(run)])
    html = (run / "drift_report" / "drift.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html
