"""metrics.jsonl: one JSON object per step, torn lines tolerated, resume truncation, the curves PNG."""

from __future__ import annotations

import json

import pytest

from vlmrl.trainer.metrics import MetricsLogger, plot_curves, read_metrics, truncate_after


def test_each_log_is_one_json_line_with_step(tmp_path):
    printed = []
    sink = MetricsLogger(tmp_path, ["console"], console=printed.append)
    sink.log(0, {"val/accuracy": 0.25})
    sink.log(1, {"reward/mean": 0.5, "timing/step": 1.5, "actor/kl_loss": float("nan")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "actor/kl_loss": None, "reward/mean": 0.5, "timing/step": 1.5},
    ]
    assert printed[1].startswith("step 1 | reward/mean 0.5")


def test_console_is_optional(tmp_path):
    printed = []
    MetricsLogger(tmp_path, [], console=printed.append).log(1, {"reward/mean": 1.0})
    assert printed == [] and read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 1.0}]


def test_a_torn_last_line_is_skipped_and_resume_truncates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(5)) + '{"step": 5, "rew')
    assert [row["step"] for row in read_metrics(path)] == [0, 1, 2, 3, 4]
    truncate_after(path, 2)
    assert [row["step"] for row in read_metrics(path)] == [0, 1, 2]
    assert path.read_text().endswith("\n")


def test_plot_has_reward_and_validation_curves(tmp_path):
    sink = MetricsLogger(tmp_path, [])
    for step in range(6):
        metrics = {"reward/mean": step / 5}
        if step % 2 == 0:
            metrics.update({"val/accuracy": step / 5, "val/synthetic/colour/accuracy": step / 5})
        sink.log(step, metrics)
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_tensorboard_sink_writes_events_or_says_how_to_install(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(RuntimeError, match="pip install tensorboard"):
            MetricsLogger(tmp_path, ["console", "tensorboard"])
        return
    sink = MetricsLogger(tmp_path, ["tensorboard"])
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_amend_adds_to_the_last_line_only(tmp_path):
    sink = MetricsLogger(tmp_path, [])
    sink.log(1, {"reward/mean": 0.5})
    sink.log(2, {"reward/mean": 0.7, "timing/step": 1.0})
    sink.amend(2, {"timing/save": 0.25, "timing/step": 1.25})
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.7, "timing/save": 0.25, "timing/step": 1.25},
    ]
    with pytest.raises(ValueError, match="the last line is not step 1"):
        sink.amend(1, {"timing/save": 0.1})
