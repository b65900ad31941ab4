"""Metric sinks: OUTPUT_DIR/metrics.jsonl (always), console, TensorBoard and W&B (optional), and the end-of-run plot.

metrics.jsonl holds one JSON object per logged step (`{"step": 3, "reward/mean": 0.4, ...}`); each line is appended
with flush + fsync, so a killed run loses at most the line being written. A step that writes a checkpoint logs its
line first and adds `timing/save` to it afterwards (the file replaced atomically), so a run killed in between still
has the line. A resumed run first drops the lines of steps after its checkpoint (they are recomputed), so the file
reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from vlmrl.atomic import replace_atomically, write_text_atomically

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
CONSOLE_KEYS = ("reward/mean", "val/accuracy", "actor/pg_loss", "actor/kl_loss", "response_length/mean", "timing/step")


def _clean(value: Any) -> Any:
    """JSON-safe: floats stay floats, non-finite becomes null (strict JSON readers reject NaN)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _row(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One metrics.jsonl line: the step first, then the metrics sorted by name, JSON-safe."""
    return {"step": step, **{key: _clean(value) for key, value in sorted(metrics.items())}}


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a torn last line of a killed run is skipped)."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s: skipping an incomplete line", path)
    return rows


def truncate_after(path: str | os.PathLike, step: int) -> None:
    """Keep only lines with step <= `step` (atomically): what a run resumed from checkpoint `step` continues from."""
    path = Path(path)
    if not path.exists():
        return
    kept = [row for row in read_metrics(path) if row.get("step", 0) <= step]
    write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in kept))


class MetricsLogger:
    """Fans each step's metrics out to every configured sink."""

    def __init__(self, output_dir: str | os.PathLike, sinks: list[str], config: dict[str, Any] | None = None,
                 project: str = "vlmrl", experiment: str = "grpo", console=None):
        """`console` is a callable taking one line (e.g. tqdm.write); None prints nothing."""
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.console = console if "console" in sinks else None
        self.tensorboard = None
        self.wandb = None
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("trainer.logger has tensorboard but it is not installed: "
                                   "pip install tensorboard (or drop it from trainer.logger)") from err
            self.tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError("trainer.logger has wandb but it is not installed: "
                                   "pip install wandb (or drop it from trainer.logger)") from err
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.output_dir),
                                    resume="allow")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = _row(step, metrics)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        numeric = self._to_sinks(step, row)
        if self.console is not None:
            shown = [f"{key} {numeric[key]:.4g}" for key in CONSOLE_KEYS if key in numeric]
            self.console(f"step {step} | " + " | ".join(shown))

    def amend(self, step: int, metrics: dict[str, Any]) -> None:
        """Add `metrics` to the line of `step`, the last one logged: what is known only after the line was written
        (e.g. the time of the checkpoint that follows it). The file is replaced atomically, so a run killed meanwhile
        keeps the line as first written."""
        rows = read_metrics(self.path)
        if not rows or rows[-1].get("step") != step:
            raise ValueError(f"{self.path}: the last line is not step {step}, so it cannot be amended")
        first = rows[-1]
        rows[-1] = _row(step, {**{k: v for k, v in first.items() if k != "step"}, **metrics})
        write_text_atomically(self.path, "".join(json.dumps(row) + "\n" for row in rows))
        # The dashboards already have the step's other values: a second point for the same step would show twice.
        self._to_sinks(step, _row(step, {k: v for k, v in metrics.items() if k not in first}))

    def _to_sinks(self, step: int, row: dict[str, Any]) -> dict[str, float]:
        """The row's numbers to TensorBoard and W&B; returns them."""
        numeric = {k: v for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tensorboard is not None:
            for key, value in numeric.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        return numeric

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def plot_curves(metrics_path: str | os.PathLike, out_path: str | os.PathLike) -> Path | None:
    """PNG of the training reward and validation accuracy (overall and per data source) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    train = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    if train:
        left.plot(*zip(*train), label="reward/mean")
    left.set(title="training reward", xlabel="step")
    # overall and per data source; not the reward part of the same name (val/reward_extra/accuracy)
    val_keys = sorted({k for r in rows for k in r
                       if k.startswith("val/") and k.endswith("/accuracy") and not k.startswith("val/reward_extra/")})
    for key in val_keys:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        right.plot(*zip(*points), marker="o", label=key, linewidth=2.5 if key == "val/accuracy" else 1)
    right.set(title="validation accuracy", xlabel="step", ylim=(-0.02, 1.02))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.tight_layout()
    try:
        return replace_atomically(out_path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
