"""python -m vlmrl.alignment.drift OUTPUT_DIR: did the trainer/engine mismatch jump during a run, when, and why?

    python -m vlmrl.alignment.drift OUTPUT_DIR [--out DIR] [--k 3] [--window 10] [--min-history 3] [--floor 1e-10]

Reads OUTPUT_DIR/drift/step_<N>.jsonl (the samples the fit loop kept, trainer.drift_fraction) and, when present,
OUTPUT_DIR/metrics.jsonl's mismatch/*. Writes DIR/drift.png (mismatch per step, jumps marked), DIR/drift.html and
DIR/drift.json (default DIR: OUTPUT_DIR/drift_report), and prints one line per jump.

The series judged is k3 = mean(w - 1 - r) over tokens (r = trainer - engine logprob, w = exp(r)): the whole batch's
`mismatch/k3` from metrics.jsonl when every sampled step has it, else the kept samples' own k3. The jump rule
(`find_jumps`), on x = log10(k3): step t jumps when k3 > floor and x_t > median(x of the up to `window` preceding
steps) + k * max(1.4826 * MAD of them, min_spread), with at least `min_history` preceding steps. So with a quiet
history a jump is at least a factor 10^(k * min_spread) = 10 above the recent median at the defaults, a noisy
history needs more, and a lasting shift stops being a jump once it fills half the window.

For each jump step its worst samples (largest k3) get a cause: `weights` when the engine sampled with another
step's weights than the trainer scored with (a weight sync that did not reach it; in the asynchronous placement, older
than its max_staleness), or when the weights probe after
the previous step's sync found the engine off the trainer's weights (OUTPUT_DIR/drift/probe_<N>.json,
`vlmrl.alignment.weight_probe`: a sync that reached the engine and landed partly); else `vision_inputs` when only
image/video samples of the step are off, else the compare tool's `logprob_drift` (the same tokens, logprobs apart
beyond its drift tolerance). Every failed probe is listed too, jump or not.

Exit status: 0 no jump and no failed probe, 1 jumps or failed probes found, 2 bad input (the error names the
file).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from vlmrl.alignment.causes import CAUSE_LABELS, Cause, Thresholds
from vlmrl.alignment.drift_artifact import DriftError, DriftRecord, read_drift
from vlmrl.alignment.weight_probe import ProbeError, ProbeRecord, read_probes
from vlmrl.atomic import write_text_atomically

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_JUMPS, EXIT_USAGE = 0, 1, 2
METRICS_FILE = "metrics.jsonl"
REPORT_DIR = "drift_report"
WORST_SHOWN = 5
K3_RESOLUTION = 1e-15
"""k3 below this is read as this: float32 logprobs one rounding step apart (~1e-7) give k3 ~5e-15, so smaller
values (0 included) are all 'equal' and must not look like decades of spread."""
MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normal data."""
WEIGHTS = "weights"
VISION = "vision_inputs"
CAUSES = {WEIGHTS: "weights: the engine sampled with other weights than the trainer's (a sync that did not land, "
                   "or landed partly)",
          VISION: "vision inputs: only the image/video samples of the step are off",
          Cause.LOGPROB_DRIFT.value: CAUSE_LABELS[Cause.LOGPROB_DRIFT],
          "within_tolerance": "within the drift tolerance"}


@dataclass
class JumpRule:
    """When a step's mismatch counts as a jump (see the module docstring)."""

    k: float = 3.0
    """How many robust standard deviations (of log10 k3) above the recent median."""
    window: int = 10
    """Preceding steps the median and MAD are taken over."""
    min_history: int = 3
    """Steps needed before any step can be judged."""
    floor: float = 1e-10
    """k3 at or below this is never a jump: 100x where float32 engine and trainer sit (~1e-13..1e-12), so float32
    rounding never jumps; a bf16 engine sits at 1e-4..1e-3, far above."""
    min_spread: float = 1 / 3
    """Smallest spread (decades) the rule divides by: a perfectly quiet history still needs a factor 10^(k x this)."""


def find_jumps(values: list[float], rule: JumpRule | None = None) -> list[int]:
    """Indices of the values that jump above the ones before them (`JumpRule`). Non-finite or missing history
    values are left out of the history; a non-finite value is itself a jump.

    >>> find_jumps([1e-12, 3e-12, 2e-12, 1e-12, 5e-4, 2e-12])
    [4]
    >>> find_jumps([1e-4, 2e-4, 1.5e-4, 1e-4, 4e-4])   # a factor 3: bf16 noise, no jump
    []
    """
    rule = rule or JumpRule()
    logs = [math.log10(max(v, K3_RESOLUTION)) if math.isfinite(v) else math.nan for v in values]
    out = []
    for t, value in enumerate(values):
        history = [x for x in logs[max(0, t - rule.window):t] if math.isfinite(x)]
        if len(history) < rule.min_history:
            continue
        if not math.isfinite(value):
            out.append(t)
            continue
        median = float(np.median(history))
        spread = max(MAD_TO_SIGMA * float(np.median(np.abs(np.asarray(history) - median))), rule.min_spread)
        if value > rule.floor and logs[t] > median + rule.k * spread:
            out.append(t)
    return out


# ---------------------------------------------------------------------------------------------------- statistics


def _gaps(record: DriftRecord) -> np.ndarray:
    """r = trainer - engine logprob per token. (T,)"""
    return np.asarray(record.trainer_logprobs, dtype=np.float64) - np.asarray(record.engine_logprobs,
                                                                             dtype=np.float64)


def k3(r: np.ndarray) -> float:
    """mean(w - 1 - r), w = exp(r): KL(engine || trainer), never negative; 0 without tokens."""
    return float(np.mean(np.expm1(r) - r)) if r.size else 0.0


@dataclass
class SampleView:
    """One kept sample as the report shows it."""

    step: int
    uid: str
    row: int
    data_source: str
    modality: str
    tokens: int
    k3: float
    max_abs_dlogp: float
    engine_weight_version: int
    trainer_weight_version: int
    weights_stale: bool = False
    """Older engine weights than the placement allows (`DriftRecord.weights_stale`)."""
    cause: str = ""
    explanation: str = ""


@dataclass
class StepView:
    """One step: the kept samples' mismatch, metrics.jsonl's when logged, and whether it jumped."""

    step: int
    samples: int
    tokens: int
    k3: float
    """Over the kept samples' tokens."""
    mean_abs_dlogp: float
    max_abs_dlogp: float
    stale_samples: int
    """Kept samples the engine generated with other weights than the trainer's."""
    engine_weight_versions: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    """metrics.jsonl's mismatch/* of this step (empty when not logged)."""
    probe_verdict: str = ""
    """The weights probe after this step's sync (empty without one): in_sync, stale, partial or differs."""
    probe_explanation: str = ""
    jump: bool = False
    worst: list[SampleView] = field(default_factory=list)
    """The jump step's worst samples, with their cause."""


@dataclass
class DriftReport:
    output_dir: str
    series: str
    """What the jump rule judged: `mismatch/k3` (metrics.jsonl, the whole batch) or `sampled k3`."""
    rule: JumpRule
    steps: list[StepView]
    drift_tolerance: float
    failed_probes: list[ProbeRecord] = field(default_factory=list)
    """The run's weight probes that found the engine off the trainer's weights (step 0's included)."""

    @property
    def jumps(self) -> list[StepView]:
        return [s for s in self.steps if s.jump]


def _view(record: DriftRecord) -> SampleView:
    r = _gaps(record)
    return SampleView(step=record.step, uid=record.uid, row=record.row, data_source=record.data_source,
                      modality=record.modality, tokens=int(r.size), k3=k3(r),
                      max_abs_dlogp=float(np.abs(r).max()) if r.size else 0.0,
                      engine_weight_version=record.engine_weight_version,
                      trainer_weight_version=record.trainer_weight_version, weights_stale=record.weights_stale)


def sample_cause(sample: SampleView, step_samples: list[SampleView], tolerance: float,
                 probe: ProbeRecord | None = None) -> tuple[str, str]:
    """The cause of one sample of a jump step (see the module docstring) and a sentence saying why. `probe`: the
    weights probe after the sync the step's rollout sampled behind (the previous step's), when the run has one."""
    if sample.weights_stale:
        return WEIGHTS, (f"the engine sampled with step {sample.engine_weight_version}'s weights, the trainer scored "
                         f"with step {sample.trainer_weight_version}'s: the sync after step "
                         f"{sample.trainer_weight_version} did not reach the engine")
    if probe is not None and probe.failed:
        return WEIGHTS, f"the weights probe after step {probe.step}'s sync: {probe.verdict}: {probe.explanation}"
    if sample.max_abs_dlogp <= tolerance:
        return "within_tolerance", f"max |dlogp| {sample.max_abs_dlogp:.3g} <= {tolerance:g}"
    text = [s for s in step_samples if s.modality == "text"]
    if sample.modality != "text" and text and all(s.max_abs_dlogp <= tolerance for s in text):
        return VISION, (f"a {sample.modality} sample {sample.max_abs_dlogp:.3g} nats off while the step's "
                        f"{len(text)} text samples stay within {tolerance:g}: look at pixels, grids, position ids")
    return Cause.LOGPROB_DRIFT.value, (f"same tokens, logprobs up to {sample.max_abs_dlogp:.3g} nats apart (k3 "
                                       f"{sample.k3:.3g}) with the engine on the trainer's weights")


def read_metrics_mismatch(path: Path) -> dict[int, dict[str, float]]:
    """{step: {mismatch/...: value}} from a metrics.jsonl (its torn last line skipped); {} when absent."""
    if not path.exists():
        return {}
    out: dict[int, dict[str, float]] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a killed run's half-written last line
                continue
            raise DriftError(f"{path}:{number}: not JSON") from None
        found = {k: float(v) for k, v in row.items() if k.startswith("mismatch/") and isinstance(v, (int, float))}
        if found and "step" in row:
            out[int(row["step"])] = found
    return out


def analyse(output_dir: str | Path, rule: JumpRule | None = None, tolerance: float | None = None) -> DriftReport:
    """Read a run's drift samples (and metrics.jsonl), judge every step with `rule`, name the jump steps' causes."""
    rule = rule or JumpRule()
    tolerance = Thresholds().drift_tolerance if tolerance is None else tolerance
    output_dir = Path(output_dir)
    records = read_drift(output_dir)
    try:
        probes = {p.step: p for p in read_probes(output_dir)}
    except ProbeError as err:
        raise DriftError(str(err)) from None
    metrics = read_metrics_mismatch(output_dir / METRICS_FILE)
    by_step: dict[int, list[SampleView]] = defaultdict(list)
    for record in records:
        by_step[record.step].append(_view(record))
    steps = []
    for step in sorted(by_step):
        views = by_step[step]
        r = np.concatenate([_gaps(rec) for rec in records if rec.step == step])
        steps.append(StepView(
            step=step, samples=len(views), tokens=int(r.size), k3=k3(r),
            mean_abs_dlogp=float(np.abs(r).mean()) if r.size else 0.0,
            max_abs_dlogp=float(np.abs(r).max()) if r.size else 0.0,
            stale_samples=sum(v.weights_stale for v in views),
            engine_weight_versions=sorted({v.engine_weight_version for v in views}),
            metrics=metrics.get(step, {}),
            probe_verdict=probes[step].verdict if step in probes else "",
            probe_explanation=probes[step].explanation if step in probes else ""))
    whole_batch = all("mismatch/k3" in s.metrics for s in steps)
    series = "mismatch/k3" if whole_batch else "sampled k3"
    values = [s.metrics["mismatch/k3"] if whole_batch else s.k3 for s in steps]
    for index in find_jumps(values, rule):
        step = steps[index]
        step.jump = True
        views = by_step[step.step]
        step.worst = sorted(views, key=lambda v: -v.k3)[:WORST_SHOWN]
        for view in step.worst:
            view.cause, view.explanation = sample_cause(view, views, tolerance, probes.get(step.step - 1))
    failed = [probes[k] for k in sorted(probes) if probes[k].failed]
    return DriftReport(str(output_dir), series, rule, steps, tolerance, failed)


# ---------------------------------------------------------------------------------------------------- outputs


def plot_png(report: DriftReport) -> bytes:
    """Mismatch per step on a log axis, jump steps marked; PNG bytes (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in report.steps]
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    tiny = 1e-16  # log axis: a zero gap is drawn at the bottom

    def line(values, label, **style):
        ax.plot(steps, [max(v, tiny) for v in values], label=label, **style)

    line([s.k3 for s in report.steps], "k3, kept samples", marker="o", markersize=3)
    if any("mismatch/k3" in s.metrics for s in report.steps):
        line([s.metrics.get("mismatch/k3", math.nan) for s in report.steps], "mismatch/k3 (metrics.jsonl)",
             marker=".", linestyle="--")
    line([s.max_abs_dlogp for s in report.steps], "max |dlogp|, kept samples", alpha=0.6)
    for s in report.jumps:
        ax.axvline(s.step, color="red", alpha=0.5, linewidth=2)
    for s in report.steps:
        if s.stale_samples:
            ax.axvspan(s.step - 0.5, s.step + 0.5, color="orange", alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("nats")
    ax.set_title(f"trainer vs engine per step (jumps in red, judged on {report.series}; stale weights shaded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def report_dict(report: DriftReport) -> dict:
    return {"kind": "vlmrl.drift_report", "format_version": 1, "output_dir": report.output_dir,
            "series": report.series, "rule": asdict(report.rule), "drift_tolerance": report.drift_tolerance,
            "jump_steps": [s.step for s in report.jumps], "steps": [asdict(s) for s in report.steps],
            "failed_probes": [{k: getattr(p, k) for k in ("step", "verdict", "explanation", "max_abs_dlogp",
                                                          "landed_fraction", "engine_version")}
                              for p in report.failed_probes]}


def render_html(report: DriftReport, png: bytes) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template("drift.html.j2").render(
        report=report, plot=base64.b64encode(png).decode("ascii"), causes=CAUSES, fmt=lambda v: f"{v:.3g}")


def write_reports(report: DriftReport, out: Path) -> list[Path]:
    """DIR/drift.png, DIR/drift.html (the plot inline) and DIR/drift.json."""
    out.mkdir(parents=True, exist_ok=True)
    png = plot_png(report)
    png_path = out / "drift.png"
    tmp = png_path.with_suffix(".png.tmp")
    tmp.write_bytes(png)
    tmp.replace(png_path)
    return [png_path, write_text_atomically(out / "drift.html", render_html(report, png)),
            write_text_atomically(out / "drift.json", json.dumps(report_dict(report), indent=1) + "\n")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlmrl.alignment.drift",
        description="Mismatch between trainer and engine over a run: a plot, an HTML report, the steps where it "
        "jumps, the cause of their worst samples, and the weight probes that found the engine off the trainer's "
        "weights.",
        epilog="Exit status: 0 no jump and no failed probe, 1 jumps or failed probes found, 2 bad input.")
    parser.add_argument("output_dir", help="the run's trainer.output_dir (holds drift/ and metrics.jsonl)")
    parser.add_argument("--out", help=f"where drift.png/html/json go (default OUTPUT_DIR/{REPORT_DIR})")
    defaults = JumpRule()
    parser.add_argument("--k", type=float, default=defaults.k, help=f"robust sigmas above the median "
                        f"(default {defaults.k:g})")
    parser.add_argument("--window", type=int, default=defaults.window, help=f"preceding steps judged against "
                        f"(default {defaults.window})")
    parser.add_argument("--min-history", type=int, default=defaults.min_history,
                        help=f"steps before any is judged (default {defaults.min_history})")
    parser.add_argument("--floor", type=float, default=defaults.floor, help=f"k3 at or below this is never a jump "
                        f"(default {defaults.floor:g})")
    parser.add_argument("--drift-tolerance", type=float, default=Thresholds().drift_tolerance,
                        help=f"per-token |dlogp| a sample may reach and still count as agreeing (default "
                        f"{Thresholds().drift_tolerance:g}, the compare tool's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    rule = JumpRule(k=args.k, window=args.window, min_history=args.min_history, floor=args.floor)
    try:
        report = analyse(args.output_dir, rule, args.drift_tolerance)
    except (DriftError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    written = write_reports(report, Path(args.out) if args.out else Path(args.output_dir) / REPORT_DIR)
    print(f"{len(report.steps)} steps, {sum(s.samples for s in report.steps)} kept samples; judged on "
          f"{report.series}; {len(report.jumps)} jump(s)")
    for step in report.jumps:
        causes = sorted({v.cause for v in step.worst})
        value = step.metrics.get("mismatch/k3", step.k3) if report.series == "mismatch/k3" else step.k3
        print(f"  step {step.step}: k3 {value:.3g} - worst samples' cause: {', '.join(causes)}")
    for probe in report.failed_probes:
        print(f"  weight probe after step {probe.step}'s sync: {probe.verdict}: {probe.explanation}")
    print("reports: " + ", ".join(map(str, written)))
    return EXIT_JUMPS if report.jumps or report.failed_probes else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
