"""Reports of a `Comparison`: a one-screen terminal summary (rich), a JSON report, and a standalone HTML page."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields
from enum import Enum
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vlmrl.alignment.causes import CAUSE_LABELS, Cause, Thresholds
from vlmrl.alignment.diff import Comparison
from vlmrl.atomic import write_text_atomically

EXAMPLES_ON_SCREEN = 5
_IDENTITY_KEYS = {"backend", "engine", "config.rollout.name"}


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _ci(interval: tuple[float, float]) -> str:
    return f"[{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _short_ci(interval: tuple[float, float]) -> str:
    """`[.07,.33]`: two decimals, no leading zero, so the terminal table fits 80 columns."""
    def short(x: float) -> str:
        return "nan" if math.isnan(x) else f"{x:.2f}".replace("0.", ".", 1)
    return f"[{short(interval[0])},{short(interval[1])}]"


def _p(value: float) -> str:
    return f"{value:.3g}"


def _short_path(path: str) -> str:
    """The last two components of a long path (cache folders are long; their names are what tells them apart)."""
    parts = Path(path).parts
    return path if len(path) <= 40 or len(parts) <= 2 else str(Path("...", *parts[-2:]))


def caller_thresholds(comparison: Comparison) -> dict[str, float]:
    """The thresholds that differ from the defaults the sides' dtypes chose: set by the caller (the command line)."""
    chosen = Thresholds(**comparison.precision.defaults)
    return {f.name: getattr(comparison.thresholds, f.name) for f in fields(Thresholds)
            if getattr(comparison.thresholds, f.name) != getattr(chosen, f.name)}


def thresholds_line(comparison: Comparison) -> str:
    """Which thresholds judged the comparison and why: the band the sides' recorded dtypes chose, its three
    precision-dependent values, and any set by the caller."""
    t, precision = comparison.thresholds, comparison.precision
    given = ", ".join(f"{name}={value:g}" for name, value in caller_thresholds(comparison).items())
    return (f"{precision.band} thresholds (near-tie margin {t.near_tie_margin:g}, drift tolerance "
            f"{t.drift_tolerance:g}, mean |dlogprob| {t.max_mean_logprob_delta:g} nats): {precision.reason}"
            + (f"; set on the command line: {given}" if given else ""))


def _side(comparison: Comparison, which: str) -> str:
    meta = comparison.meta_a if which == "a" else comparison.meta_b
    label = comparison.label_a if which == "a" else comparison.label_b
    return f"{label} ({meta.engine} {meta.engine_version})"


# ---------------------------------------------------------------------------------------------- JSON


def _plain(value: Any) -> Any:
    """asdict output -> JSON-safe values (enums by value, NaN/inf as strings so any JSON reader accepts the file)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {(k.value if isinstance(k, Enum) else str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def report_dict(comparison: Comparison) -> dict[str, Any]:
    """The JSON report: verdict, checks, settings that differ, scores, cause counts, and every sample's diff."""
    return _plain({
        "kind": "vlmrl.alignment_report",
        "format_version": 1,
        "ok": comparison.ok,
        "a": {"label": comparison.label_a, **asdict(comparison.meta_a)},
        "b": {"label": comparison.label_b, **asdict(comparison.meta_b)},
        "greedy": comparison.greedy,
        "thresholds": {"band": comparison.precision.band, "reason": comparison.precision.reason,
                       "dtype_a": comparison.precision.dtype_a, "dtype_b": comparison.precision.dtype_b,
                       "values": asdict(comparison.thresholds), "set_by_caller": caller_thresholds(comparison),
                       "line": thresholds_line(comparison)},
        "setting_differences": [{"key": k, "a": a, "b": b} for k, a, b in comparison.setting_differences],
        "summary": {
            "samples": comparison.total,
            "exact": comparison.exact,
            "causes": {cause.value: comparison.cause_counts.get(cause, 0) for cause in Cause},
            "max_abs_logprob_delta": comparison.max_abs_logprob_delta,
            "mean_abs_logprob_delta": comparison.mean_abs_logprob_delta,
        },
        "scores": {source: asdict(score) for source, score in comparison.scores.items()},
        "reward_parts": {k: {"a": a, "b": b} for k, (a, b) in comparison.reward_parts.items()},
        "checks": [asdict(check) for check in comparison.checks],
        "samples": [{**asdict(s), "reward_delta": s.reward_delta} for s in comparison.samples],
    })


def write_json_report(comparison: Comparison, path: str | os.PathLike) -> Path:
    text = json.dumps(report_dict(comparison), indent=1, default=str, allow_nan=False)
    return write_text_atomically(path, text + "\n")


# ---------------------------------------------------------------------------------------------- terminal


def _samples_table(comparison: Comparison) -> Table:
    table = Table(title="Samples", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False,
                  collapse_padding=True)
    table.add_column("outcome")
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    total = max(comparison.total, 1)
    table.add_row("exact (same inputs, tokens, finish, reward)", str(comparison.exact),
                  f"{comparison.exact / total:.1%}")
    for cause in Cause:
        count = comparison.cause_counts.get(cause, 0)
        if count == 0:  # one screen: only the outcomes that happened (the reports list every cause)
            continue
        style = "yellow" if cause in (Cause.NEAR_TIE, Cause.LOGPROB_DRIFT) else "red"
        table.add_row(Text(CAUSE_LABELS[cause], style=style), str(count), f"{count / total:.1%}")
    return table


def _scores_table(comparison: Comparison) -> Table:
    table = Table(title="Scores (mean reward per row, 95% bootstrap CI, paired test p)", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False, show_edge=False, collapse_padding=True)
    for name, justify in (("source", "left"), ("rows", "right"), (comparison.label_a, "right"),
                          (comparison.label_b, "right"), ("delta (B-A)", "right"), ("p", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for source, s in comparison.scores.items():
        table.add_row(source, str(s.rows), f"{_fmt(s.mean_a)} {_short_ci(s.ci_a)}",
                      f"{_fmt(s.mean_b)} {_short_ci(s.ci_b)}", f"{s.delta:+.3f} {_short_ci(s.ci_delta)}", _p(s.p_value))
    return table


def _decoding(comparison: Comparison) -> str:
    if "trainer" in (comparison.meta_a.backend, comparison.meta_b.backend):
        return "teacher-forced (the trainer scored the engine's tokens)"
    return "greedy" if comparison.greedy else "SAMPLED: tokens not compared"


def drill_down_line(drill: dict[str, Any]) -> str:
    """One line for the trainer side's per-module comparison (`vlmrl.alignment.drill_down`)."""
    where = f"row {drill['index']} #{drill['sample_index']}"
    routing = drill.get("routing")
    routed = ""
    if routing is not None:
        routed = ("; routing: the same experts at every token" if routing["first_layer"] is None else
                  f"; routing first differs at MoE layer {routing['first_layer']} (token {routing['first_token']}; "
                  f"{routing['differing_pairs']} of {routing['tokens'] * routing['layers']} (token, layer) pairs)")
    if drill.get("first") is None:
        return (f"drill-down on {where}: every one of {len(drill['modules'])} modules within "
                f"{drill['tolerance']:g} (relative) of transformers{routed}")
    module = next(m for m in drill["modules"] if m["name"] == drill["first"])
    return (f"drill-down on {where}: the divergence starts at {drill['first']} (max |d| {module['max_abs']:.3g}, "
            f"{module['max_abs'] / max(module['scale'], 1e-12):.2g} of its scale; tolerance {drill['tolerance']:g})"
            f"{routed}")


def print_summary(comparison: Comparison, console: Console | None = None, report_paths: list[Path] = ()) -> None:
    """The one-screen summary: what was compared, settings that differ, outcomes, scores, examples, verdict."""
    console = console or Console()
    meta = comparison.meta_a
    console.rule(f"vlmrl alignment: {_side(comparison, 'a')} vs {_side(comparison, 'b')}")
    data = ", ".join(_short_path(p) for p in meta.dataset.paths)
    console.print(f"model {_short_path(meta.model_path)} | data {data} ({meta.dataset.rows} rows) | "
                  f"{comparison.total} samples | {_decoding(comparison)}")
    # The backend's own name differs by design; show the settings that could explain a difference.
    settings = [d for d in comparison.setting_differences if d[0] not in _IDENTITY_KEYS]
    if settings:
        shown = settings[:6]
        more = len(settings) - len(shown)
        console.print("settings that differ: " + "; ".join(f"{k}: {a!r} vs {b!r}" for k, a, b in shown)
                      + (f" (+{more} more in the report)" if more else ""))
    for label, meta in ((comparison.label_a, comparison.meta_a), (comparison.label_b, comparison.meta_b)):
        for problem in meta.engine_problems:
            console.print(f"{label}'s engine was started without a setting its model needs: {problem}", markup=False)
    console.print(_samples_table(comparison))
    console.print(f"logprobs over common prefixes: max |delta| {_fmt(comparison.max_abs_logprob_delta, 6)}, "
                  f"mean |delta| {_fmt(comparison.mean_abs_logprob_delta, 6)} nats")
    console.print(_scores_table(comparison))
    if comparison.reward_parts:
        console.print("reward parts (A vs B): " + ", ".join(
            f"{k} {_fmt(a)} vs {_fmt(b)}" for k, (a, b) in comparison.reward_parts.items()))
    for meta in (comparison.meta_a, comparison.meta_b):
        if meta.drill_down:
            console.print(drill_down_line(meta.drill_down), markup=False)
    differing = comparison.differing()
    for sample in differing[:EXAMPLES_ON_SCREEN]:
        console.print(f"  row {sample.index} #{sample.sample_index} [{CAUSE_LABELS[sample.cause]}] "
                      f"{sample.explanation}", overflow="ellipsis", no_wrap=True, markup=False)
    if len(differing) > EXAMPLES_ON_SCREEN:
        console.print(f"  ... {len(differing) - EXAMPLES_ON_SCREEN} more differing samples in the report")
    console.print(thresholds_line(comparison), markup=False)
    for check in comparison.checks:
        if not check.ok:
            console.print(f"[red]FAIL[/red] {check.name}: {check.value:.4g} > {check.limit:.4g} ({check.detail})")
    verdict = "[bold green]ALIGNED[/bold green]" if comparison.ok else "[bold red]NOT ALIGNED[/bold red]"
    console.print(f"{verdict} within thresholds" + (" | reports: " + ", ".join(map(str, report_paths))
                                                     if report_paths else ""))

