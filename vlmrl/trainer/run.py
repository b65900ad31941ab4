"""The records of a training run: what it holds between steps (`Run`), what a step's rollout and scoring give the
update (`Rollout`, `StepBatch`), the interface of its placement (`Placement`), the step's phase timer, and when a
periodic action is due."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vlmrl.actor.base import PolicyActor
from vlmrl.config import Config
from vlmrl.data.dataset import BatchSampler, PromptQueue, RLDataset
from vlmrl.trainer.components import RunComponents
from vlmrl.trainer.engine_probe import WeightProbe
from vlmrl.trainer.metrics import MetricsLogger
from vlmrl.types import RolloutRequest, RolloutResult, Sample, SamplingParams, TrainBatch


class PhaseTimer:
    """`with timer("rollout"): ...` records seconds per phase; `metrics()` gives timing/<phase> and timing/step."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - begin

    def elapsed(self) -> float:
        """Seconds since the timer started."""
        return time.perf_counter() - self.start

    def metrics(self) -> dict[str, float]:
        return {**{f"timing/{k}": v for k, v in self.seconds.items()}, "timing/step": self.elapsed()}


@dataclass
class StepBatch:
    """What a step's rollout and scoring hand the update, the same for a plain and a multi-turn rollout."""

    batch: TrainBatch
    """Scored samples, stacked, plus padding rows up to a whole number of mini-batches over the dp ranks."""
    rollout_metrics: dict[str, float]
    """The agent loop's metrics (agent/*, partial/*), dynamic sampling's (batch/dynamic_sampling_draws,
    batch/groups_dropped, batch/groups_surplus) and the overlong shaping's (reward/overlong_penalty)."""
    reward_failures: int
    """Samples whose reward function failed or overran reward.timeout_s (they score 0)."""
    filtered_prompts: int
    """Prompts of the step skipped by the processor (over data.max_prompt_length, bad images)."""
    engine_version: int = 0
    """The step whose weights the engine held when it generated the batch (its last draw's)."""
    requests: list[RolloutRequest] = field(default_factory=list)
    """The requests the batch's samples were generated from (every draw's; a row's by its uid): what an engine
    teacher scores them after (algorithm.distill.teacher_engine)."""


@dataclass
class Rollout:
    """A step's finished samples before scoring."""

    requests: list[RolloutRequest]
    samples: list[Sample]
    """Padded, request-major, n per request."""
    answers: list[str]
    """What the reward function reads of each sample: the decoded response, or a trajectory's last assistant turn."""
    metrics: dict[str, float]
    filtered: int
    engine_version: int = 0
    """The step whose weights the engine held when it generated the batch."""
    rows: list[int] = field(default_factory=list)
    """The dataset rows drawn for it (a plain rollout's; the filtered ones included)."""
    results: list[RolloutResult] = field(default_factory=list)
    """The engine's results, request-major (a plain rollout's): what a checkpoint of the async buffer keeps."""


class Placement(Protocol):
    """Where a step's batch comes from and how the trainer's new weights reach the engine: the one interface the loop
    calls (`vlmrl.trainer.placement`: the synchronous colocated placement and the asynchronous one)."""

    def collect(self, run: Run, step: int, sampling: SamplingParams) -> Rollout:
        """Step `step`'s rollout (its samples before scoring)."""

    def sync(self, run: Run, step: int, timer: PhaseTimer, step_metrics: Callable[[], dict[str, float]]
             ) -> dict[str, float]:
        """Step `step`'s weights into the engine (timing/weight_sync) and the weights probe where it runs;
        `step_metrics()` gives the step's metrics once the sync is done. Returns them with the sync's."""

    def engine(self) -> contextlib.AbstractContextManager:
        """The engine to the trainer while the block runs (validation on one fixed version of the weights)."""

    def data_state(self, run: Run) -> dict:
        """The data position after the last batch trained on (what a checkpoint keeps)."""

    def checkpoint_writer(self) -> Callable[[Path], None] | None:
        """What a checkpoint keeps of the placement beyond the data position (written into its folder), or None."""

    def restore(self, run: Run, checkpoint: Path) -> None:
        """Take back what `checkpoint_writer` kept in `checkpoint`."""

    def close(self) -> None:
        """Stop what the placement started."""


@dataclass
class Run:
    """Everything a training run holds between steps."""

    config: Config
    output_dir: Path
    parts: RunComponents
    """The processor, reward (function, worker processes, judge), validation set, rollout backend and agent loop,
    shared with validation."""
    train_data: RLDataset
    sampler: BatchSampler
    actor: PolicyActor
    """The single-process Actor, or vlmrl.distributed's DistributedActor when dp_size > 1."""
    sink: MetricsLogger
    total_steps: int
    placement: Placement
    """Where each step's batch comes from and how a sync reaches the engine: the synchronous colocated placement or
    the asynchronous one (trainer.async_rollout.enable)."""
    dp_size: int = 1
    step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    prompts: PromptQueue | None = None
    """Prompt indices for the agent loop, which may ask for more or fewer than a batch (partial rollout)."""
    engine_version: int = 0
    """The step whose weights the engine holds: set by each sync that reached it (`sync_engine`)."""
    probe: WeightProbe | None = None
    """The weights probe after every sync (trainer.weight_probe_tokens > 0)."""

    def data_state(self) -> dict:
        """The data position a checkpoint keeps: after the last batch trained on (the asynchronous placement's
        rollout thread may have drawn further)."""
        return self.placement.data_state(self)

    def close(self) -> None:
        """Stops what the run started (the placement's threads, the agent loop, the engines, the reward's worker
        processes and judge, the metric sinks), the later ones also when closing an earlier one fails."""
        try:
            self.placement.close()
        finally:
            try:
                self.parts.close()
            finally:
                self.sink.close()


def due(freq: int, step: int, total: int) -> bool:
    """Whether a periodic action every `freq` steps (0: never) is due after step `step` of `total` (the last always)."""
    return freq > 0 and (step % freq == 0 or step == total)
