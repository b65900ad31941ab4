"""The GRPO fit loop: each step is a sequence of named, timed phases.

    rollout -> reward [-> more rollouts and rewards: dynamic sampling] -> old_logprobs (when the batch gets more
            than one optimizer step, or rollout correction is on) -> [drift: a few samples' logprobs kept] ->
            ref_logprobs (KL only) -> advantages -> update -> weight_sync -> [weight_probe] -> [validate] -> [save]

A plain and a multi-turn (agent.enable) rollout differ only inside `collect_step`; both give a `StepBatch`. One
`PhaseTimer` per step times every phase (timing/<phase>; timing/step is the whole step). Everything else (setup,
resume, checkpoints, validate-only mode) is a small function around it. Step numbering: the initial weights are
step 0 (validated when trainer.val_before_train); step k is the state after k updates.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vlmrl.actor.base import PolicyActor
from vlmrl.actor.local import Actor
from vlmrl.algorithms.advantages import compute_advantages
from vlmrl.algorithms.correction import rollout_correction
from vlmrl.algorithms.dapo import groups_with_signal, mask_truncated, overlong_penalty, select_groups
from vlmrl.alignment.drift_artifact import DRIFT_DIR, drop_steps_after, write_step
from vlmrl.atomic import write_text_atomically
from vlmrl.batch.padding import batch_metrics, pad_results, required_batch_multiple, scored_batch
from vlmrl.config import Config, to_dict, to_yaml
from vlmrl.data.dataset import BatchSampler, PromptQueue, RLDataset, build_requests, load_dataset, sequential_batches
from vlmrl.processors.qwen_vl import Processor
from vlmrl.rewards.base import TIMEOUT_KEY
from vlmrl.rewards.scoring import load_reward_fn, response_texts, score_texts
from vlmrl.rewards.workers import close_reward_workers
from vlmrl.rollout.base import DTYPES
from vlmrl.rollout.segments import generate_in_segments
from vlmrl.trainer.async_rollout import (
    BUFFER_FILE,
    CONSUMED_FILE,
    AsyncRollout,
    Produced,
    append_consumed,
    buffer_records,
    read_buffer,
    staleness_counts,
    write_buffer,
)
from vlmrl.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint_state,
    refuse_earlier_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    tidy_checkpoints,
)
from vlmrl.trainer.components import (
    RunComponents,
    load_run_processor,
    start_agent,
    start_rollout_workers,
    start_run_backend,
)
from vlmrl.trainer.drift import drift_records, drift_rows, trainer_logprobs
from vlmrl.trainer.metrics import METRICS_FILE, PLOT_FILE, MetricsLogger, plot_curves, truncate_after
from vlmrl.trainer.throughput import throughput_metrics
from vlmrl.trainer.validation import load_val_dataset, run_validation, validate_with
from vlmrl.trainer.warmup import format_warmup
from vlmrl.trainer.weight_probe import WeightProbe
from vlmrl.types import RolloutRequest, RolloutResult, Sample, SamplingParams, TrainBatch

logger = logging.getLogger(__name__)


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
class Run:
    """Everything a training run holds between steps."""

    config: Config
    output_dir: Path
    parts: RunComponents
    """The processor, reward function, validation set, rollout backend and agent loop, shared with validation."""
    train_data: RLDataset
    sampler: BatchSampler
    actor: PolicyActor
    """The single-process Actor, or vlmrl.distributed's DistributedActor when dp_size > 1."""
    sink: MetricsLogger
    total_steps: int
    dp_size: int = 1
    step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    prompts: PromptQueue | None = None
    """Prompt indices for the agent loop, which may ask for more or fewer than a batch (partial rollout)."""
    engine_version: int = 0
    """The step whose weights the engine holds: set by each sync that reached it (`sync_engine`)."""
    probe: WeightProbe | None = None
    """The weights probe after every sync (trainer.weight_probe_tokens > 0)."""
    async_rollout: AsyncRollout | None = None
    """The rollout thread of the asynchronous placement (trainer.async_rollout.enable), started at step 1's rollout."""
    dropped_batches: int = 0
    """Batches a checkpoint kept that the resumed settings do not allow (`restore_buffer`), for the next step's
    async/dropped_batches."""
    staleness_counts: collections.Counter | None = None
    """{staleness: batches trained on} over the run so far (async/staleness_hist/*), read from CONSUMED_FILE at the
    first asynchronous step (a resumed run's counts the steps before its checkpoint)."""
    restored_batches: list = field(default_factory=list)
    """The asynchronous placement's batches a checkpoint kept (`restore_buffer`): the resumed thread's buffer
    starts with them."""

    def engine(self):
        """The engine to itself while the block runs: in the asynchronous placement after the rollout thread's batch
        in flight (or at its next segment boundary, trainer.async_rollout.interrupt_tokens), nothing to wait for
        otherwise."""
        return self.async_rollout.exclusive() if self.async_rollout is not None else contextlib.nullcontext()

    def data_state(self) -> dict:
        """The data position a checkpoint keeps: after the last batch trained on (the rollout thread may have drawn
        further)."""
        if self.async_rollout is not None and self.async_rollout.consumed_data_state is not None:
            return dict(self.async_rollout.consumed_data_state)
        return self.sampler.state_dict()

    def close(self) -> None:
        if self.async_rollout is not None:
            self.async_rollout.close()
        self.parts.close()
        self.sink.close()
        close_reward_workers()


# ---------------------------------------------------------------------------------------------------- the loop


def fit(config: Config, stop: Callable[[int, dict[str, float]], bool] | None = None) -> dict[str, float]:
    """Train (or, with trainer.val_only, only validate). Returns the last logged metrics.

    `stop` (for a program driving the run, as an early-stopping callback does): called with (step, metrics) for
    every logged line, step 0's included; the run ends after the first step it returns True for, with that step
    saved as a run's last step is (a checkpoint, `latest` pointing at it)."""
    setup_process(config)
    if config.trainer.val_only:
        return validate_only(config)
    run = setup_run(config)
    try:
        if run.step == 0:
            start_of_training(run)
        from tqdm import tqdm

        progress = tqdm(total=run.total_steps, initial=run.step, desc="GRPO", unit="step", file=sys.stderr,
                        dynamic_ncols=True, disable=None)
        stopped = stop is not None and run.step == 0 and bool(run.last_metrics) and stop(0, run.last_metrics)
        while run.step < run.total_steps and not stopped:
            metrics = run_step(run)
            progress.update(1)
            progress.set_postfix({short: round(metrics[key], 3) for key, short in
                                  (("reward/mean", "reward"), ("val/accuracy", "val_acc")) if key in metrics})
            stopped = stop is not None and stop(run.step, metrics)
            if stopped and "timing/save" not in metrics and run.step > 0:
                save(run)
        progress.close()
        if stopped:
            logger.info("stopped after step %d of %d: the caller's stop condition held", run.step, run.total_steps)
        plot = plot_curves(run.output_dir / METRICS_FILE, run.output_dir / PLOT_FILE)
        logger.info("done: %d steps; metrics %s; curves %s", run.step, run.output_dir / METRICS_FILE, plot)
        return run.last_metrics
    finally:
        run.close()


def run_step(run: Run) -> dict[str, float]:
    """One training step, then validation and a checkpoint when due; logs and returns the step's metrics."""
    t = run.config.trainer
    timer = PhaseTimer()
    metrics = train_step(run, timer)
    run.step += 1
    if _due(t.test_freq, run.step, run.total_steps) and run.parts.val_data is not None:
        with timer("validate"), run.engine():  # on one fixed version of the weights
            metrics.update(validate(run))
    metrics.update(timer.metrics())
    run.sink.log(run.step, metrics)  # before the checkpoint: a run resumed from it finds the line of its step
    if _due(t.save_freq, run.step, run.total_steps):
        with timer("save"):
            save(run)
        saved = {"timing/save": timer.seconds["save"], "timing/step": timer.elapsed()}  # the step grows by the save
        run.sink.amend(run.step, saved)
        metrics.update(saved)
    run.last_metrics = metrics
    return metrics


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


def train_step(run: Run, timer: PhaseTimer) -> dict[str, float]:
    """One GRPO step on the next batch of prompts, its phases timed by `timer`; returns its metrics without the
    timings (the caller adds them once the step, validation and checkpoint included, is over)."""
    cfg, step = run.config, run.step + 1
    collected = collect_step(run, step, timer)
    batch = collected.batch
    backend = run.parts.backend
    if backend.releases_memory():  # the engine frees its memory while the actor trains; the sync takes it back
        with timer("engine_sleep"):
            backend.sleep()
    old_logprobs = None  # one optimizer step on fresh samples: the update's own forward gives them (ratio 1)
    # Carried partial-rollout tokens came from older policies: the current weights are not the ones that sampled them,
    # so the trainer recomputes old logprobs with the weights about to be updated (verl's recompute).
    carries = cfg.agent.enable and cfg.agent.partial.enable
    # rollout correction compares the engine's logprobs with the trainer's before the update: it needs the pass
    bypass = cfg.algorithm.rollout_correction == "bypass"
    if bypass:  # verl's bypass mode: the engine's logprobs anchor the PPO ratio; no recomputing pass
        if batch.rollout_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction=bypass needs the engine's logprobs, which backend "
                             f"{cfg.rollout.name} did not return")
        old_logprobs = batch.rollout_logprobs
    elif carries or cfg.algorithm.rollout_correction != "off" or run.actor.needs_old_logprobs(len(batch)):
        with timer("old_logprobs"):
            old_logprobs, _ = run.actor.compute_logprobs(batch)
    if cfg.trainer.drift_fraction > 0 and batch.rollout_logprobs is not None:
        with timer("drift"):  # bypass: the engine's own logprobs are no trainer measurement; the drift rows get one
            keep_drift_samples(run, batch, None if bypass else old_logprobs, step, collected.engine_version)
    ref_logprobs = None
    if cfg.actor.use_kl_loss:
        with timer("ref_logprobs"):
            ref_logprobs, _ = run.actor.compute_logprobs(batch, reference=True)
    with timer("advantages"):
        al = cfg.algorithm
        advantages = compute_advantages(al.adv_estimator, batch.rewards, batch.uids, batch.is_padding,
                                        batch.response_mask, norm_by_std=al.norm_adv_by_std_in_grpo)
        loss_batch, loss_weights, loss_metrics = loss_inputs(cfg, batch, old_logprobs)
    with timer("update"):
        actor_metrics = run.actor.update(loss_batch, old_logprobs, advantages, ref_logprobs, loss_weights,
                                         old_from_engine=bypass)
    in_flight = run.async_rollout is not None and run.async_rollout.in_flight

    def step_out() -> dict[str, float]:  # throughput over rollout -> weight sync, as EasyR1's
        return {**batch_metrics(batch), **actor_metrics, **collected.rollout_metrics, **loss_metrics,
                **step_metrics(collected, run, timer)}

    if run.async_rollout is not None and cfg.trainer.async_rollout.staged_sync and not syncs_in_full(run, step):
        with timer("weight_sync"):  # a copy, loaded by the rollout thread before its next batch: no wait here
            run.async_rollout.stage(step, staged_weights(run))
        return {**step_out(), "async/sync_wait_s": 0.0, "async/sync_found_in_flight": float(in_flight),
                "async/sync_staged": 1.0}
    waiting = time.perf_counter()
    with run.engine():  # the sync and the probe of what it left, with no batch of the rollout thread in between
        waited = time.perf_counter() - waiting  # for the batch in flight (asynchronous placement)
        if run.async_rollout is not None:
            run.async_rollout.unstage()  # older than what this sync loads
        with timer("weight_sync"):
            sync_engine(run, step)
        metrics = step_out()
        if run.probe is not None:
            with timer("weight_probe"):
                metrics.update(run.probe(run.actor, backend, step, run.engine_version))
        if run.async_rollout is not None:
            # a batch in flight finished on the old weights first, or (interrupt_tokens) goes on with the new ones
            metrics.update({"async/sync_wait_s": waited, "async/sync_found_in_flight": float(in_flight)})
            run.async_rollout.synced(run.engine_version)
    return metrics


def keep_drift_samples(run: Run, batch: TrainBatch, old_logprobs: torch.Tensor | None, step: int,
                       engine_version: int) -> None:
    """OUTPUT_DIR/drift/step_<step>.jsonl: trainer.drift_fraction of the step's samples, with the engine's and the
    trainer's pre-update logprobs of their loss tokens (one forward over those rows unless old_logprobs exist).
    `engine_version`: the step whose weights the engine sampled the batch with."""
    cfg, processor = run.config, run.parts.processor
    rows = drift_rows(batch.is_padding, cfg.trainer.drift_fraction, cfg.trainer.seed, step)
    trainer = trainer_logprobs(run.actor, batch, rows, old_logprobs, eos_token_id=processor.eos_token_ids[0],
                               pad_token_id=processor.pad_token_id)
    a = cfg.trainer.async_rollout
    write_step(run.output_dir, step, drift_records(batch, rows, trainer, step=step, engine_version=engine_version,
                                                   max_staleness=a.max_staleness if a.enable else 0,
                                                   temperature=cfg.rollout.temperature))


def sync_engine(run: Run, step: int, weights: list[tuple[str, torch.Tensor]] | None = None) -> bool:
    """Step `step`'s weights into the engine (`weights`: a staged copy of them; None: the actor's own). A sync that
    never reached it (the backend counted no weight load) is said, and the engine keeps its version: the next
    step's drift samples then show the stale weights. Returns whether it landed."""
    backend = run.parts.backend
    loads = backend.weight_loads
    if weights is None:
        run.actor.sync_weights(backend)
    else:
        backend.update_weights(weights)
    if backend.weight_loads > loads:
        run.engine_version = step
        return True
    logger.warning("step %d: the weight sync loaded nothing into the %s engine: it still holds step %d's weights",
                   step, backend.name, run.engine_version)
    return False


def syncs_in_full(run: Run, step: int) -> bool:
    """With trainer.async_rollout.staged_sync: whether step `step` still waits for its sync (and probes it), as the
    steps that validate or save, and the last one, do."""
    t = run.config.trainer
    return (step == run.total_steps or _due(t.save_freq, step, run.total_steps)
            or (_due(t.test_freq, step, run.total_steps) and run.parts.val_data is not None))


def staged_weights(run: Run) -> list[tuple[str, torch.Tensor]]:
    """A copy of the actor's weights in the engine's dtype, which the next update does not write to: what a staged
    sync hands the rollout thread (trainer.async_rollout.staged_sync)."""
    backend = run.parts.backend
    dtype = DTYPES[backend.options.resolved_dtype(backend.processor.family)]
    return [(name, tensor.detach().to(dtype=dtype, copy=True)) for name, tensor in run.actor.named_tensors()]


def loss_inputs(config: Config, batch: TrainBatch, old_logprobs: torch.Tensor | None
                ) -> tuple[TrainBatch, torch.Tensor | None, dict[str, float]]:
    """The batch the update sees, with its response_mask made the LOSS mask, and the per-token loss weights:
    rollout correction (algorithm.rollout_correction; needs old_logprobs) and DAPO's mask_truncated. Returns
    (batch, (B, R) weights or None, their metrics: rollout_correction/*, batch/truncated_masked)."""
    al = config.algorithm
    mask, weights, metrics = batch.response_mask, None, {}
    if al.rollout_correction not in ("off", "bypass"):  # bypass: old_logprobs are the engine's; the ratio corrects
        if batch.rollout_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction={al.rollout_correction} needs the engine's logprobs, "
                             f"which backend {config.rollout.name} did not return")
        corr = rollout_correction(old_logprobs, batch.rollout_logprobs, mask, al.rollout_correction,
                                  token_cap=al.rollout_correction_token_cap, seq_low=al.rollout_correction_seq_low,
                                  seq_high=al.rollout_correction_seq_high, seq_ratio=al.rollout_correction_seq_ratio,
                                  token_low=al.rollout_correction_token_low,
                                  token_high=al.rollout_correction_token_high)
        mask, weights = corr.mask, corr.weights
        metrics.update({f"rollout_correction/{key}": value for key, value in corr.metrics.items()})
    if al.mask_truncated:
        cut = mask_truncated(mask, batch.finish_reasons)
        real = int((~batch.is_padding).sum())
        metrics["batch/truncated_masked"] = float((mask.any(-1) & ~cut.any(-1)).sum()) / max(real, 1)
        mask = cut
    return (batch if mask is batch.response_mask else replace(batch, response_mask=mask)), weights, metrics


def collect_step(run: Run, step: int, timer: PhaseTimer) -> StepBatch:
    """Step `step`'s batch: roll out its prompts (plain or multi-turn, timing/rollout), score every sample
    (timing/reward; DAPO's overlong shaping added to the rewards), keep the groups the batch takes, and stack them.
    With algorithm.dynamic_sampling only groups with reward signal are kept (`select_groups`) and more prompts are
    drawn, from the same (checkpointed) sampler with a seed that depends only on (trainer.seed, step, draw), until
    data.train_batch_size groups have signal or algorithm.dynamic_sampling_max_extra_draws extra draws are spent;
    then the step trains on what it has."""
    cfg, al = run.config, run.config.algorithm
    wanted = cfg.data.train_batch_size
    kept = Scored([], [], [], [])
    failures = filtered = groups = dropped = surplus = draw = 0
    while True:
        sampling = training_sampling(cfg, step, draw)
        with timer("rollout"):
            if cfg.trainer.async_rollout.enable:  # made on the rollout thread, maybe while the last update ran
                rollout = async_rollout(run, step)
            elif run.parts.agent is None:
                rollout = plain_rollout(run, step, sampling)
            else:
                rollout = agent_rollout(run, step, sampling)
        with timer("reward"):
            scored, draw_failures = score_rollout(run, rollout, sampling)
        failures, filtered = failures + draw_failures, filtered + rollout.filtered
        if al.dynamic_sampling:
            pick = select_groups(torch.tensor(scored.rewards, dtype=torch.float64),
                                 [s.uid for s in scored.samples], room=wanted - groups)
            groups, dropped, surplus = groups + pick.taken, dropped + pick.dropped, surplus + pick.surplus
            rows = pick.rows
            last_chance = groups >= wanted or draw >= al.dynamic_sampling_max_extra_draws
            if not kept.samples and not rows and last_chance:
                logger.warning("step %d: no group with reward signal in %d draws: training on the last draw's groups "
                               "(their advantages are 0)", step, draw + 1)
                rows = list(range(len(scored.samples)))
            kept = kept + scored.select(rows)
        else:
            kept = scored
        if not al.dynamic_sampling or groups >= wanted or draw >= al.dynamic_sampling_max_extra_draws:
            break
        draw += 1
    metrics = dict(rollout.metrics)
    if al.dynamic_sampling:
        if groups < wanted:
            logger.warning("step %d: %d of %d groups with reward signal after %d extra draws (algorithm."
                           "dynamic_sampling_max_extra_draws); training on those", step, groups, wanted, draw)
        metrics.update({"batch/dynamic_sampling_draws": float(draw), "batch/groups_dropped": float(dropped),
                        "batch/groups_surplus": float(surplus)})
    if al.overlong_buffer_len > 0:
        metrics["reward/overlong_penalty"] = sum(kept.penalties) / max(len(kept.penalties), 1)
    with timer("reward"):
        processor = run.parts.processor
        batch = scored_batch(kept.samples, kept.rewards, kept.parts,
                             multiple=required_batch_multiple(run.dp_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.n),
                             eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)
    return StepBatch(batch, metrics, failures, filtered, rollout.engine_version)


@dataclass
class Scored:
    """Samples with their rewards (shaping included), reward parts and overlong penalties, row for row."""

    samples: list[Sample]
    rewards: list[float]
    parts: list[dict[str, float]]
    penalties: list[float]

    def select(self, rows: list[int]) -> Scored:
        return Scored(*([column[i] for i in rows] for column in (self.samples, self.rewards, self.parts,
                                                                  self.penalties)))

    def __add__(self, other: Scored) -> Scored:
        return Scored(self.samples + other.samples, self.rewards + other.rewards, self.parts + other.parts,
                      self.penalties + other.penalties)


def score_rollout(run: Run, rollout: Rollout, sampling: SamplingParams) -> tuple[Scored, int]:
    """The reward of every sample of a rollout, with DAPO's overlong shaping added (algorithm.overlong_buffer_len);
    returns them and the number of samples whose reward function failed."""
    cfg, al = run.config, run.config.algorithm
    scores = score_texts(run.parts.reward_fn, rollout.requests, rollout.answers, sampling.n, cfg.reward)
    values = torch.tensor(scores.values, dtype=torch.float64)
    penalty = torch.zeros_like(values)
    if al.overlong_buffer_len > 0:
        lengths = torch.tensor([int(s.attention_mask[len(s.prompt_ids):].sum()) for s in rollout.samples])
        penalty = overlong_penalty(lengths, cfg.data.max_response_length, al.overlong_buffer_len,
                                   al.overlong_penalty_factor).to(torch.float64)
        values = values + penalty
    return Scored(list(rollout.samples), values.tolist(), list(scores.parts), penalty.tolist()), scores.failures


def async_rollout(run: Run, step: int) -> Rollout:
    """Step `step`'s batch from the asynchronous placement's rollout thread (started here at the first step, once
    the format warm-up and step 0's validation are done), with its async/* metrics."""
    if run.async_rollout is None:
        a = run.config.trainer.async_rollout
        preload, run.restored_batches = run.restored_batches, []
        if preload:  # the thread draws on after the batches a checkpoint kept
            run.sampler.load_state_dict(preload[-1].data_state)
        run.async_rollout = AsyncRollout(
            produce=lambda s, version: plain_rollout(run, s, training_sampling(run.config, s), policy_version=version,
                                                     segment_tokens=a.interrupt_tokens),
            data_state=run.sampler.state_dict, max_staleness=a.max_staleness, buffer_steps=a.buffer_steps,
            timeout_s=run.config.rollout.timeout_s, first_step=step + len(preload), engine_version=run.engine_version,
            last_step=run.total_steps, preload=preload,
            load=lambda version, weights: sync_engine(run, version, weights))
    produced, metrics = run.async_rollout.take(step)
    if run.config.trainer.async_rollout.rollout_workers > 0:  # RemoteEngines: workers started again after dying
        metrics["async/worker_restarts"] = float(run.parts.backend.restarts)
    if run.config.trainer.async_rollout.interrupt_tokens > 0:
        metrics["async/interrupts"] = float(run.async_rollout.interrupts)  # over the run
    if run.config.trainer.async_rollout.staged_sync:  # over the run
        metrics.update({"async/staged_loads": float(run.async_rollout.staged_loads),
                        "async/staged_replaced": float(run.async_rollout.staged_replaced),
                        "async/staged_load_s": run.async_rollout.load_s})
    if run.dropped_batches:  # kept by the checkpoint, beyond the resumed bound: drawn again
        metrics["async/dropped_batches"], run.dropped_batches = float(run.dropped_batches), 0
    if run.staleness_counts is None:
        run.staleness_counts = staleness_counts(run.output_dir)
    run.staleness_counts[int(metrics["async/staleness"])] += 1
    # the run's staleness histogram so far: batches trained on at each staleness 0..max_staleness
    metrics.update({f"async/staleness_hist/{k}": float(run.staleness_counts.get(k, 0))
                    for k in range(run.config.trainer.async_rollout.max_staleness + 1)})
    produced.rollout.metrics.update(metrics)
    append_consumed(run.output_dir, step, produced.version, [r.index for r in produced.rollout.requests],
                    produced.rollout.results)
    return produced.rollout


def plain_rollout(run: Run, step: int, sampling: SamplingParams, policy_version: int | None = None,
                  segment_tokens: int = 0) -> Rollout:
    """The next batch of prompts, generated in one backend call and padded per sample. `policy_version`: the step
    whose weights the engine holds (default step - 1: the synchronous loop's). `segment_tokens` > 0 (the
    asynchronous placement's interrupt_tokens): generated in segments, the trainer's waiting calls let in between
    them (`vlmrl.rollout.segments`); its samples whose segments had different weights are counted
    (async/mixed_version_samples)."""
    rows = list(next(run.sampler))
    built = build_requests(run.parts.processor, run.train_data, rows)
    if not built.requests:
        raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
    version = run.engine_version
    if segment_tokens > 0:
        results, versions = generate_in_segments(run.parts.backend, built.requests, sampling, segment_tokens,
                                                 version, between=run.async_rollout.let_in)
    else:
        results = run.parts.backend.generate(built.requests, sampling)
    rollout = finish_rollout(run, built, rows, results, version,
                             step - 1 if policy_version is None else policy_version)
    if segment_tokens > 0:
        rollout.metrics["async/mixed_version_samples"] = float(sum(first != last for first, last in versions))
    return rollout


def finish_rollout(run: Run, built, rows: list[int], results: list[RolloutResult], engine_version: int,
                   policy_version: int) -> Rollout:
    """A plain rollout from its requests (`build_requests` of `rows`) and the engine's results: padded per sample,
    the responses decoded."""
    d = run.config.data
    samples = pad_results([run.parts.processor.prompt_inputs(r) for r in built.requests], results,
                          prompt_length=d.max_prompt_length, response_length=d.max_response_length,
                          pad_token_id=run.parts.processor.pad_token_id, policy_version=policy_version)
    texts = response_texts(run.parts.processor.tokenizer, results)
    return Rollout(built.requests, samples, texts, {}, built.num_skipped, engine_version, rows, results)


def restore_buffer(run: Run, records: list[dict], checkpoint: Path) -> list[Produced]:
    """The batches a checkpoint kept of the asynchronous placement's buffer (`write_buffer`), rebuilt from their
    rows and results: the resumed run trains on them with the versions that sampled them, as the uninterrupted run
    would have. A batch the resumed settings no longer allow (older than max_staleness) and every one after it are
    dropped, counted in the log, and drawn again."""
    kept: list[Produced] = []
    bound = run.config.trainer.async_rollout.max_staleness
    run.dropped_batches = 0
    for record in records:
        step = run.step + 1 + len(kept)
        if record["step"] != step or step - 1 - record["version"] > bound:
            logger.warning("%s: %d of the %d buffered batches are dropped (step %d's, sampled with step %d's weights, "
                           "is beyond trainer.async_rollout.max_staleness=%d or out of order): drawn again",
                           checkpoint, len(records) - len(kept), len(records), record["step"], record["version"],
                           bound)
            run.dropped_batches = len(records) - len(kept)
            break
        built = build_requests(run.parts.processor, run.train_data, record["rows"])
        results = record["results"]
        n = len(results) // max(1, len(built.requests))
        if not built.requests or n * len(built.requests) != len(results):
            raise ValueError(f"{checkpoint / BUFFER_FILE}: step {step}'s batch has {len(results)} results for "
                             f"{len(built.requests)} requests of rows {record['rows']}: the data changed since")
        results = [replace(r, uid=built.requests[i // n].uid) for i, r in enumerate(results)]  # uids are per run
        rollout = finish_rollout(run, built, record["rows"], results, record["version"], record["version"])
        kept.append(Produced(step, record["version"], rollout, record["data_state"], record["generate_s"], 0.0))
    return kept


def agent_rollout(run: Run, step: int, sampling: SamplingParams) -> Rollout:
    """Multi-turn conversations for a batch of prompts (with partial rollout: carried groups first, then new ones
    from the prompt queue, until a batch of groups has finished); each trajectory is padded as it ends."""
    size = run.config.data.train_batch_size
    built = build_requests(run.parts.processor, run.train_data, run.prompts.take(run.parts.agent.prompts_needed(size)))
    if not built.requests and not run.parts.agent.carried:
        raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
    rolled = run.parts.agent.step(built.requests, sampling, batch_size=size, policy_version=step - 1)
    if not rolled.samples:
        raise RuntimeError(f"step {step}: the agent loop finished no group (see the partial rollout warning)")
    return Rollout(rolled.requests, rolled.train_samples, rolled.final_answers, rolled.metrics, built.num_skipped,
                   run.engine_version)


def step_metrics(collected: StepBatch, run: Run, timer: PhaseTimer) -> dict[str, float]:
    """Metrics beyond batch_metrics and the actor's: reward failures and timeouts (timeouts are failures too),
    filtered prompts, groups with signal, the response tokens per second of the step so far, and the step's tokens/s
    per GPU and the update's MFU (vlmrl.trainer.throughput)."""
    batch = collected.batch
    real = ~batch.is_padding
    tokens = float((batch.response_mask * real.unsqueeze(-1)).sum())
    return {
        "reward/failures": float(collected.reward_failures),
        "reward/timeouts": float(sum(extra.get(TIMEOUT_KEY, 0.0) for extra in batch.reward_extra)),  # padding rows: {}
        "batch/filtered_prompts": float(collected.filtered_prompts),
        "batch/groups_with_signal": _share_of_groups_with_signal(batch),
        "epoch": float(run.data_state()["epoch"]),
        "throughput/response_tokens_per_s": tokens / max(timer.elapsed(), 1e-9),
        **throughput_metrics(run.config, batch, timer.elapsed(), timer.seconds["update"]),
    }


def _share_of_groups_with_signal(batch: TrainBatch) -> float:
    """Fraction of prompts whose samples got different rewards (the same rule dynamic sampling and the group
    estimators use)."""
    real_groups = {uid for uid, padding in zip(batch.uids, batch.is_padding.tolist()) if not padding}
    return len(groups_with_signal(batch.rewards, batch.uids, batch.is_padding)) / max(len(real_groups), 1)


def training_sampling(config: Config, step: int, draw: int = 0) -> SamplingParams:
    """Sampling of step `step`'s draw `draw` (0, then dynamic sampling's extra draws): seeded by (trainer.seed,
    step, draw) only, so a resumed run draws what an uninterrupted one would."""
    r = config.rollout
    seed = (config.trainer.seed * 7_919 + step * 1_000_003 + draw * 104_729) % (2**31)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=config.data.max_response_length, seed=seed)


def validate(run: Run) -> dict[str, float]:
    return run_validation(run.parts, step=run.step).metrics


def _due(freq: int, step: int, total: int) -> bool:
    return freq > 0 and (step % freq == 0 or step == total)


# ---------------------------------------------------------------------------------------------------- setup


def setup_process(config: Config) -> None:
    if config.trainer.torch_threads > 0:
        torch.set_num_threads(config.trainer.torch_threads)
    torch.manual_seed(config.trainer.seed)
    Path(config.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    logger.info("torch %s, %d threads, pid %d, output %s", torch.__version__, torch.get_num_threads(), os.getpid(),
                config.trainer.output_dir)


def setup_run(config: Config) -> Run:
    """Build every component; resume from the newest complete checkpoint in output_dir when there is one. When a
    step fails, what was already started (engines, Ray workers, reward workers) is closed before the error goes on."""
    opened: list[Callable[[], None]] = [close_reward_workers]
    try:
        return _build_run(config, opened)
    except BaseException:
        for close in reversed(opened):
            try:
                close()
            except Exception as err:  # noqa: BLE001 - the original error is the one to report
                logger.warning("closing after a failed setup: %s", err)
        raise


def _build_run(config: Config, opened: list[Callable[[], None]]) -> Run:
    """setup_run's body; appends each started component's close to `opened`."""
    t, d = config.trainer, config.data
    output_dir = Path(t.output_dir)
    if not t.resume:
        refuse_earlier_checkpoints(output_dir)
    else:  # what a killed run left half done (moved-aside, half-deleted or temporary folders; one too many kept)
        tidy_checkpoints(output_dir, t.max_ckpt_to_keep)
    write_text_atomically(output_dir / "config.yaml", to_yaml(config))
    processor = load_run_processor(config)
    train_data = load_dataset(d.train_files, "train", prompt_key=d.prompt_key, image_key=d.image_key,
                              synthetic_train_size=d.synthetic_train_size, synthetic_val_size=d.synthetic_val_size,
                              synthetic_seed=t.seed)
    val_data = load_val_dataset(config) if d.val_files else None
    sampler = BatchSampler(len(train_data), d.train_batch_size, shuffle=d.shuffle, seed=t.seed)
    total_steps = t.total_steps or t.total_epochs * sampler.batches_per_epoch
    checkpoint = latest_checkpoint(output_dir) if t.resume else None
    init_path = str(checkpoint) if checkpoint else None
    if checkpoint is not None:  # the data position first: the batch checked below is the one the run starts with
        state, info = load_checkpoint_state(checkpoint)
        sampler.load_state_dict(info["data"])
    check_requests(config, processor, train_data, sampler.peek(), val_data)  # before any process starts
    sources = train_data.data_sources() + (val_data.data_sources() if val_data else [])
    reward_fn = load_reward_fn(config.reward, sources)
    dp_size = config.derived.world_size
    actor: PolicyActor
    workers = t.async_rollout.rollout_workers if t.async_rollout.enable else 0
    if dp_size > 1 and workers > 0:  # Ray workers that only train, beside rollout workers of their own
        from vlmrl.distributed.group import ensure_ray
        from vlmrl.distributed.launch import start_distributed

        ensure_ray(dp_size + workers)  # a local cluster: a CPU for each
        actor, _ = start_distributed(config, total_steps, init_path, engines=False)
        opened.append(actor.close)
        backend = start_rollout_workers(config, None if config.actor.lora.enabled else init_path)
        backend.close_after.append(actor.close)  # the run closes its backend: the training workers go with it
        opened.append(backend.close)
    elif dp_size > 1:  # Ray workers with FSDP2-sharded actors and colocated engines; the loop stays the same
        from vlmrl.distributed.launch import start_distributed

        actor, backend = start_distributed(config, total_steps, init_path)
        opened.append(backend.close)  # stops the workers too
    else:
        actor = Actor(config.actor, total_steps, config.derived.mini_batch_samples,
                      temperature=config.rollout.temperature, init_path=init_path)
        # A resumed backend starts from the checkpoint folder (HF format): weights already in sync. With LoRA it
        # starts on the base model (an adapter applies to the base) and gets the policy's weights below.
        # asynchronous: the engine generates while the actor trains, so it never gives its memory back to it
        start_path = None if config.actor.lora.enabled else init_path
        if workers > 0:  # engines in processes of their own
            backend = start_rollout_workers(config, start_path)
        else:
            backend = start_run_backend(config, model_path=start_path, colocated=not t.async_rollout.enable)
        opened.append(backend.close)
    if checkpoint is not None and config.actor.lora.enabled:
        actor.sync_weights(backend)
    step = 0
    if checkpoint is not None:
        actor.load_state_dict(state["actor"])
        set_rng_state(state["rng"])
        step = int(info["step"])
        logger.info("resuming from %s (step %d of %d)", checkpoint, step, total_steps)
        truncate_after(output_dir / METRICS_FILE, step)
        truncate_after(output_dir / CONSUMED_FILE, step)
        drop_steps_after(output_dir, step)
    else:
        stamp = time.strftime('%Y%m%d-%H%M%S')
        for name in (METRICS_FILE, DRIFT_DIR, CONSUMED_FILE):  # a run starting over keeps the old run's aside
            if (output_dir / name).exists():
                kept = output_dir / f"{name}.{stamp}"
                os.replace(output_dir / name, kept)
                logger.warning("%s exists but there is no checkpoint to resume from: starting over (old one kept "
                               "in %s)", output_dir / name, kept)
    from tqdm import tqdm

    sink = MetricsLogger(output_dir, t.logger, to_dict(config), t.project_name, t.experiment_name, console=tqdm.write)
    opened.append(sink.close)
    parts = RunComponents(config, processor, reward_fn, backend, val_data)
    run = Run(config, output_dir, parts, train_data, sampler, actor, sink, total_steps, dp_size, step,
              engine_version=step)  # the engine starts on the checkpoint's weights (or synced them just above)
    if t.weight_probe_tokens > 0:
        run.probe = WeightProbe.for_run(config, processor, train_data, output_dir)
        if checkpoint is not None and "weight_probe" in info:  # judge the next probe as the uninterrupted run does
            run.probe.load_state_dict(info["weight_probe"])
    if checkpoint is not None and t.async_rollout.enable:
        records = read_buffer(checkpoint)
        if records is not None:
            run.restored_batches = restore_buffer(run, records, checkpoint)
    if config.agent.enable:
        parts.agent, run.prompts = start_agent(config, backend, processor), PromptQueue(sampler)
        opened.append(parts.agent.close)
        if checkpoint is not None:
            resume_agent(run, checkpoint, info)
    return run


def check_requests(config: Config, processor: Processor, train_data: RLDataset, first_batch: list[int],
                   val_data: RLDataset | None) -> None:
    """Build (and drop) the request of every validation row and of the first training batch's rows before any
    engine, actor or reward worker starts: a bad row then fails in seconds with one message naming its row, file and
    cause, instead of after an engine start (25-90 s on 2 CPU cores). Later training batches are built as their step
    comes."""
    begin = time.perf_counter()
    checked = len(first_batch)
    build_requests(processor, train_data, first_batch)
    if val_data is not None:
        for indices in sequential_batches(len(val_data), config.data.val_batch_size):  # a call's worth at a time
            build_requests(processor, val_data, indices)
        checked += len(val_data)
    logger.info("checked %d rows (the first training batch%s) in %.1f s: each builds a request", checked,
                " and the validation set" if val_data is not None else "", time.perf_counter() - begin)


def resume_agent(run: Run, checkpoint: Path, info: dict) -> None:
    """The agent loop's share of a checkpoint: prompts taken from the sampler but not started (not re-issued, not
    skipped), and the groups partial rollout carried into the next step, exactly where they parked."""
    if "prompt_queue" in info:
        run.prompts.pending = [int(i) for i in info["prompt_queue"]]
    else:  # written before checkpoints kept it: those prompts are skipped
        logger.warning("%s has no prompt-queue position (an older checkpoint): prompts drawn from the sampler but "
                       "not started before it was saved are skipped", checkpoint)
    run.parts.agent.restore_carried(checkpoint)


def start_of_training(run: Run) -> None:
    """Step 0: the optional format warm-up (then a weight sync), then validation of the starting weights."""
    t = run.config.trainer
    timer = PhaseTimer()
    metrics: dict[str, float] = {}
    if t.format_warmup_steps > 0:
        with timer("format_warmup"):
            losses = format_warmup(run.actor, run.parts.processor, run.train_data, run.config)
            sync_engine(run, 0)  # the warmed-up weights are step 0's
        metrics.update({"warmup/loss_first": losses[0], "warmup/loss_last": losses[-1]})
    if run.probe is not None:  # the engine's starting weights against the trainer's: what later probes start from
        with timer("weight_probe"):
            probed = run.probe(run.actor, run.parts.backend, 0, run.engine_version)
        if metrics or (t.val_before_train and run.parts.val_data is not None):  # where step 0 logs a line anyway
            metrics.update(probed)
    if t.val_before_train and run.parts.val_data is not None:
        with timer("validate"):
            metrics.update(validate(run))
    if metrics:
        metrics.update(timer.metrics())
        run.sink.log(0, metrics)
        run.last_metrics = metrics


def save(run: Run) -> Path:
    model = run.actor.full_model()  # at dp > 1 gathered from the shards
    info = {"data": run.data_state(), "total_steps": run.total_steps, "config": to_dict(run.config)}
    if run.parts.agent is not None:
        # Prompts taken from the sampler but not started yet; the carried groups go into files of their own.
        info.update(prompt_queue=list(run.prompts.pending), agent_carried_groups=len(run.parts.agent.carried))
    if run.probe is not None:  # the last probe in sync: what the next probe is judged against
        info["weight_probe"] = run.probe.state_dict()
    agent = run.parts.agent

    buffered = buffer_records(run.async_rollout.pending()) if run.async_rollout is not None else None

    def write_extra(folder: Path) -> None:  # the LoRA adapter, the agent's carried groups, the async buffer
        run.actor.save_adapter(folder)
        if agent is not None:
            agent.save_carried(folder)
        if buffered is not None:
            write_buffer(folder, buffered)

    path = save_checkpoint(
        run.output_dir, run.step, model, run.config.actor.model_path,
        trainer_state={"actor": run.actor.state_dict(), "rng": rng_state()}, info=info,
        keep=run.config.trainer.max_ckpt_to_keep, write_extra=write_extra)
    logger.info("saved step %d: %s", run.step, path)
    return path


# ---------------------------------------------------------------------------------------------------- validate-only


def validate_only(config: Config) -> dict[str, float]:
    """Validate `actor.model_path` with `rollout.name`: no actor, no optimizer, the weights are only read.
    Writes OUTPUT_DIR/validation_<backend>_step<N>.jsonl (the artifact) and a metrics.jsonl line."""
    output_dir = Path(config.trainer.output_dir)
    step = _checkpoint_step(config.actor.model_path)
    name = config.rollout.name
    artifact = output_dir / f"validation_{name}_step{step}.jsonl"
    try:
        result = validate_with(config, name, step=step, artifact_path=artifact)
    finally:
        close_reward_workers()
    sink = MetricsLogger(output_dir, config.trainer.logger, to_dict(config), config.trainer.project_name,
                         config.trainer.experiment_name, console=print)
    sink.log(step, result.metrics)
    sink.close()
    logger.info("validate-only: val/accuracy %.4f over %d samples; artifact %s", result.metrics["val/accuracy"],
                int(result.metrics["val/num_samples"]), artifact)
    return result.metrics


def _checkpoint_step(model_path: str) -> int:
    """The training step of a vlmrl checkpoint folder (0 for any other model)."""
    state = Path(model_path) / "trainer_state.json"
    if state.is_file():
        import json

        return int(json.loads(state.read_text()).get("step", 0))
    return 0
