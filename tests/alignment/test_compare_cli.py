"""`python -m vlmrl.alignment.compare A B`: exit status, reports on disk, and clear errors for bad input."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from tests.alignment.toy_artifacts import write_side
from vlmrl.alignment.compare import main


class _TagBalance(HTMLParser):
    """Counts unclosed elements: a report with a broken tag renders half the page inside another element."""

    VOID = {"meta", "img", "br", "hr", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.images = 0
        self.marks = 0

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images += 1
        if tag == "mark":
            self.marks += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def _html(path):
    checker = _TagBalance()
    checker.feed(path.read_text())
    assert checker.stack == [], f"unclosed: {checker.stack}"
    return checker


def test_aligned_artifacts_exit_0_with_reports(tmp_path, capsys):
    a, b = write_side(tmp_path / "a.jsonl"), write_side(tmp_path / "b.jsonl", backend="sglang")
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] is True and report["summary"]["exact"] == 30 and report["a"]["label"] == "vllm"
    page = _html(tmp_path / "out" / "report.html")
    assert page.images == 30 and page.marks == 0
    assert "ALIGNED" in capsys.readouterr().out


def test_perturbed_side_exits_1_and_the_report_shows_where(tmp_path, capsys):
    a, b = write_side(tmp_path / "a.jsonl"), write_side(tmp_path / "b.jsonl", backend="sglang", logit_noise=2.0)
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["causes"]["real_divergence"] == 30
    assert report["samples"][0]["divergence"]["position"] == 0
    page = _html(tmp_path / "out" / "report.html")
    assert page.marks == 60, "both sides' text is highlighted from the divergence on"
    out = capsys.readouterr().out
    assert "NOT ALIGNED" in out and "real divergence" in out


def test_thresholds_are_configurable(tmp_path):
    a, b = write_side(tmp_path / "a.jsonl"), write_side(tmp_path / "b.jsonl", backend="sglang", logit_noise=2.0)
    loose = ["--max-real-divergence", "1", "--max-mean-logprob-delta", "10", "--no-html"]
    assert main([str(a), str(b), "--out", str(tmp_path / "out"), *loose]) == 0
    assert not (tmp_path / "out" / "report.html").exists()


def test_truncated_artifact_exits_2_with_a_clear_message(tmp_path, capsys):
    a, b = write_side(tmp_path / "a.jsonl"), write_side(tmp_path / "b.jsonl", backend="sglang")
    b.write_bytes(b.read_bytes()[:-100])
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "b.jsonl" in err and "truncated" in err
    assert not (tmp_path / "out").exists(), "no report for a comparison that did not happen"


def test_artifact_from_another_dataset_exits_2(tmp_path, capsys):
    a = write_side(tmp_path / "a.jsonl")
    b = write_side(tmp_path / "b.jsonl", backend="sglang", dataset="geo3k:test")
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    assert "different datasets" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["only_one.jsonl"], "exactly two artifact files"),
        (["--backends", "vllm", "config=x.yaml"], "exactly two names"),
        (["--backends", "vllm,sglang", "not_an_override"], "key=value"),
        (["--backends", "vllm", "--out", "x", "config=y.yaml"], "exactly two names"),  # overrides after a flag
        (["--backends", "vllm,nope", "actor.model_path=tiny"], "unknown backend(s) ['nope']"),
        (["--backends", "hf,vllm", "no.such_key=1"], "unknown config key"),
    ],
)
def test_bad_usage_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_flag_exits_2():
    assert main(["a", "b", "--no-such-flag"]) == 2


def test_an_artifact_cannot_put_markup_into_the_report(tmp_path):
    """A shared artifact is data: a thumbnail or image size carrying HTML must not become part of the page."""
    import dataclasses

    from tests.alignment.toy_artifacts import make_side
    from vlmrl.alignment.artifact import write_artifact

    meta, records = make_side(rows=2)
    hostile = '"><script>alert(1)</script><img src="'
    records[0] = dataclasses.replace(records[0], thumbnails=[hostile], image_sizes=[["<b>28</b>", 28]])
    a = write_artifact(tmp_path / "a.jsonl", meta, records)
    b = write_side(tmp_path / "b.jsonl", rows=2, backend="sglang")
    main([str(a), str(b), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.html").read_text()
    assert "<script>alert" not in text and "<b>28</b>" not in text
    assert "thumbnail is not base64" in text
    _html(tmp_path / "out" / "report.html")


def test_python_dash_m_gives_exit_2_for_bad_usage():
    """Run as documented (python -m): a usage error raised by the --backends checks must still be exit 2, not a
    traceback with exit 1, which a CI gate would read as 'not aligned'."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "vlmrl.alignment.compare", "--backends", "vllm,foo",
                           "config=examples/configs/tiny_synthetic.yaml"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unknown backend(s) ['foo']" in done.stdout + done.stderr and "Traceback" not in done.stderr


def _failing_val_data(tmp_path):
    """A parquet without a prompt column: the config is valid, the validation run fails when it reads the data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "What colour?"}]), path)
    return path


@pytest.mark.slow  # a whole `python -m vlmrl.train` child process
def test_a_failed_backend_run_exits_2_naming_the_backend_and_its_log(tmp_path, tiny_model_path, capsys):
    """`--backends` runs each side as `python -m vlmrl.train ... trainer.val_only=true`: a run that fails is a clear
    error (which side, which backend, where its log is), not a traceback, and the second side never starts."""
    out = tmp_path / "out"
    status = main(["--backends", "hf,vllm", f"actor.model_path={tiny_model_path}",
                   f"data.val_files={_failing_val_data(tmp_path)}", "data.min_pixels=3136", "data.max_pixels=12544",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2
    message = next(line for line in err.splitlines() if line.startswith("error: "))  # one line, never wrapped
    assert f"side A hf: the validation run exited with status 2; its log: {out / 'val_a_hf.log'}" in message
    assert "no prompt column 'prompt'" in (out / "val_a_hf.log").read_text(), "the child's own error is kept"
    assert "[A hf] " in err, "the run's output is shown as it comes"
    assert not (out / "val_b_vllm.log").exists() and not (out / "report.json").exists()


def test_a_backend_run_past_its_bound_is_stopped_and_exits_2(tmp_path, tiny_model_path, capsys, monkeypatch):
    import vlmrl.alignment.compare as compare

    monkeypatch.setattr(compare, "run_timeout_s", lambda config: 0.5)
    status = main(["--backends", "hf,vllm", f"actor.model_path={tiny_model_path}",
                   f"data.val_files={_failing_val_data(tmp_path)}", "--out", str(tmp_path / "out")])
    assert status == 2
    assert "side A hf: the validation run did not finish within 0.5 s" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("dtype, exit_code", [("float32", 1), ("bfloat16", 0)])
def test_a_small_uniform_logprob_drift_fails_only_between_float32_sides(tmp_path, dtype, exit_code):
    """Same tokens everywhere, every logprob 5e-4 nats off on one side: rounding between bf16 engines, but a
    computation that differs between fp32 ones, whose correct engines agree to ~1e-5 (SGLang's cross-patch video
    attention looked like this: 1e-3..7e-3 per token, a mean the earlier fp32 limit of 1e-3 let through)."""
    from tests.alignment.toy_artifacts import make_side
    from vlmrl.alignment.artifact import write_artifact

    paths = []
    for name, backend, shift in (("a", "vllm", 0.0), ("b", "sglang", 5e-4)):
        meta, records = make_side(backend=backend)
        meta.config["rollout"]["dtype"] = dtype
        for record in records:
            record.response_logprobs = [value - shift for value in record.response_logprobs]
        paths.append(write_artifact(tmp_path / f"{name}.jsonl", meta, records))
    assert main([str(paths[0]), str(paths[1]), "--out", str(tmp_path / "out")]) == exit_code
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["max_abs_logprob_delta"] == pytest.approx(5e-4, rel=1e-3)
    failed = [check["name"] for check in report["checks"] if not check["ok"]]
    assert failed == (["mean |logprob delta| (nats)"] if dtype == "float32" else [])


def test_the_report_says_which_thresholds_judged_it_and_why(tmp_path, capsys):
    """The terminal summary, report.json and report.html name the thresholds' band, their values and the reason: the
    dtype each header records (the sides here configured `auto`), and any set on the command line."""
    from tests.alignment.toy_artifacts import make_side
    from vlmrl.alignment.artifact import write_artifact

    paths = []
    for name, backend in (("a", "vllm"), ("b", "sglang")):
        meta, records = make_side(backend=backend)
        meta.config["rollout"]["dtype"], meta.dtype = "auto", "float32"
        paths.append(write_artifact(tmp_path / f"{name}.jsonl", meta, records))
    assert main([*map(str, paths), "--out", str(tmp_path / "out"), "--near-tie-margin", "0.02"]) == 0
    line = ("float32 thresholds (near-tie margin 0.02, drift tolerance 0.001, mean |dlogprob| 0.0001 nats): both sides "
            "computed in float32 or wider (vllm float32, sglang float32); set on the command line: "
            "near_tie_margin=0.02")
    assert line in " ".join(capsys.readouterr().out.split())
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["thresholds"]["line"] == line and report["thresholds"]["set_by_caller"] == {"near_tie_margin": 0.02}
    assert line in (tmp_path / "out" / "report.html").read_text()
