"""The GRPO fit loop: each step is a sequence of named, timed phases.

    collect (rollout -> reward [-> more rollouts and rewards: dynamic sampling]) -> [engine_sleep] -> old_logprobs
    (`old_logprob_source`) -> [drift: a few samples' logprobs kept] -> ref_logprobs (KL only) -> teacher_logprobs
    (distillation only) -> advantages -> update -> weight_sync -> [weight_probe] -> [validate] -> [save]

Where the batch comes from and how the sync reaches the engine is the run's placement (`vlmrl.trainer.placement`:
synchronous colocated, or asynchronous); a plain and a multi-turn rollout differ only inside it; both give a
`StepBatch` (`vlmrl.trainer.collect`). One `PhaseTimer` per step times every phase (timing/<phase>; timing/step is
the whole step). Setup, resume and validate-only mode live in `vlmrl.trainer.setup`. Step numbering: the initial
weights are step 0 (validated when trainer.val_before_train); step k is the state after k updates.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from vlmrl.actor.base import PolicyActor
from vlmrl.algorithms.advantages import compute_advantages
from vlmrl.algorithms.correction import rollout_correction
from vlmrl.algorithms.config import DistillConfig
from vlmrl.algorithms.dapo import mask_truncated
from vlmrl.algorithms.distill import distill_advantages, distill_metrics, mixed_advantages
from vlmrl.alignment.drift_artifact import write_step
from vlmrl.batch.padding import batch_metrics
from vlmrl.config import Config, to_dict
from vlmrl.trainer.checkpoint import rng_state, save_checkpoint
from vlmrl.trainer.collect import collect_step, step_metrics
from vlmrl.trainer.drift_samples import drift_records, drift_rows, trainer_logprobs
from vlmrl.trainer.metrics import METRICS_FILE, PLOT_FILE, plot_curves
from vlmrl.trainer.placement import sync_engine
from vlmrl.trainer.run import PhaseTimer, Run, due
from vlmrl.trainer.setup import setup_process, setup_run, validate_only
from vlmrl.trainer.teacher_engine import TeacherScores, teacher_scores
from vlmrl.trainer.validation import run_validation
from vlmrl.trainer.warmup import format_warmup
from vlmrl.types import TrainBatch

logger = logging.getLogger(__name__)

__all__ = ["PhaseTimer", "fit", "save", "setup_process", "setup_run", "train_step", "validate_only"]


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
        elif run.probe is not None:  # resumed: its engine, started again, computes the trainer's model
            run.probe.check_resumed(run.actor, run.parts.backend, run.step, run.engine_version)
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
    if due(t.test_freq, run.step, run.total_steps) and run.parts.val_data is not None:
        with timer("validate"), run.placement.engine():  # on one fixed version of the weights
            metrics.update(validate(run))
    metrics.update(timer.metrics())
    run.sink.log(run.step, metrics)  # before the checkpoint: a run resumed from it finds the line of its step
    if due(t.save_freq, run.step, run.total_steps):
        with timer("save"):
            save(run)
        saved = {"timing/save": timer.seconds["save"], "timing/step": timer.elapsed()}  # the step grows by the save
        run.sink.amend(run.step, saved)
        metrics.update(saved)
    run.last_metrics = metrics
    return metrics


def train_step(run: Run, timer: PhaseTimer) -> dict[str, float]:
    """One GRPO step on the next batch of prompts, its phases timed by `timer`; returns its metrics without the
    timings (the caller adds them once the step, validation and checkpoint included, is over)."""
    cfg, step, actor, backend = run.config, run.step + 1, run.actor, run.parts.backend
    collected = collect_step(run, step, timer)
    batch = collected.batch
    if backend.releases_memory():  # the engine frees its memory while the actor trains; the sync takes it back
        with timer("engine_sleep"):
            backend.sleep()
    source = old_logprob_source(cfg, batch, actor)
    old_logprobs = batch.rollout_logprobs if source == "engine" else None
    if source == "recompute":
        with timer("old_logprobs"):
            old_logprobs, _ = actor.compute_logprobs(batch, record_routing=True)  # a MoE policy's routing kept
    if cfg.trainer.drift_fraction > 0 and batch.rollout_logprobs is not None:
        with timer("drift"):  # the engine's own logprobs are no trainer measurement: the drift rows then get one
            keep_drift_samples(run, batch, None if source == "engine" else old_logprobs, step, collected.engine_version)
    ref_logprobs = None
    if cfg.actor.use_kl_loss:
        with timer("ref_logprobs"):
            ref_logprobs, _ = actor.compute_logprobs(batch, reference=True)
    teacher, teacher_metrics = None, {}
    if cfg.algorithm.distill.enabled:  # the teacher scores the student's rows as they are (same ids and images)
        with timer("teacher_logprobs"):  # in the trainer, or on its engine from the rows' requests
            teacher, teacher_metrics = teacher_scores(cfg, actor, run.parts.teacher, batch, collected.requests)
    with timer("advantages"):
        al = cfg.algorithm
        advantages = compute_advantages(al.adv_estimator, batch.rewards, batch.uids, batch.is_padding,
                                        batch.response_mask, norm_by_std=al.norm_adv_by_std_in_grpo)
        loss_batch, loss_weights, loss_metrics = loss_inputs(cfg, batch, old_logprobs)
        if teacher is not None:
            advantages, loss_batch = distill_inputs(al.distill, loss_batch, advantages, old_logprobs, teacher)
            loss_metrics.update(distill_metrics(old_logprobs, teacher.logprobs, batch.response_mask,
                                                teacher.topk_logprobs), **teacher_metrics)
    with timer("update"):
        actor_metrics = actor.update(loss_batch, old_logprobs, advantages, ref_logprobs, loss_weights,
                                     old_from_engine=source == "engine")

    def step_out() -> dict[str, float]:  # once the sync is done: throughput over rollout -> weight sync, as EasyR1's
        return {**batch_metrics(batch), **actor_metrics, **collected.rollout_metrics, **loss_metrics,
                **step_metrics(collected, run, timer, actor_metrics)}

    return run.placement.sync(run, step, timer, step_out)


def old_logprob_source(config: Config, batch: TrainBatch, actor: PolicyActor) -> str:
    """Where the PPO ratio's old logprobs come from:
    - "engine": algorithm.rollout_correction=bypass (verl's bypass mode): the engine's own logprobs anchor the ratio,
      no recomputing pass;
    - "recompute": a trainer forward before the update, when the batch gets more than one optimizer step, rollout
      correction compares the engine's logprobs with the trainer's, partial rollout carried tokens sampled by
      older policies (verl's recompute), or on-policy distillation needs the student's logprobs beside the teacher's;
    - "update": one optimizer step on fresh samples: the update's own forward gives them (ratio 1)."""
    if config.algorithm.rollout_correction == "bypass":
        if batch.rollout_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction=bypass needs the engine's logprobs, which backend "
                             f"{config.rollout.name} did not return")
        return "engine"
    carries = config.agent.enable and config.agent.partial.enable
    if carries or config.algorithm.rollout_correction != "off" or config.algorithm.distill.enabled or \
            actor.needs_old_logprobs(len(batch)):
        return "recompute"
    return "update"


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


def distill_inputs(config: DistillConfig, batch: TrainBatch, advantages: torch.Tensor, student: torch.Tensor,
                   teacher: TeacherScores) -> tuple[torch.Tensor, TrainBatch]:
    """On-policy distillation's part of the update's inputs (`vlmrl.algorithms.distill`), over the loss mask of
    `batch` (the update's): the advantages, reward_weight times the reward's, plus (mode=advantage) the (B, R)
    per-token distillation advantages from the student's pre-update logprobs `student` and the teacher's; or
    (mode=loss) the batch carrying the teacher's logprobs (estimator=forward_kl_topk: its top-k ids and logprobs),
    from which the update adds coef x the distillation loss."""
    mask = batch.response_mask
    per_token = (distill_advantages(student, teacher.logprobs, mask, config.discount, config.coef,
                                    config.loss_max_clamp)
                 if config.mode == "advantage" else None)
    advantages = mixed_advantages(advantages, per_token, mask, config.reward_weight)
    if config.mode != "loss":
        return advantages, batch
    if teacher.topk_ids is not None:
        return advantages, replace(batch, teacher_topk_ids=teacher.topk_ids,
                                   teacher_topk_logprobs=teacher.topk_logprobs)
    return advantages, replace(batch, teacher_logprobs=teacher.logprobs)


def keep_drift_samples(run: Run, batch: TrainBatch, old_logprobs: torch.Tensor | None, step: int,
                       engine_version: int) -> None:
    """OUTPUT_DIR/drift/step_<step>.jsonl: trainer.drift_fraction of the step's samples, with the engine's and the
    trainer's pre-update logprobs of their loss tokens (one forward over those rows unless old_logprobs exist).
    `engine_version`: the step whose weights the engine sampled the batch with."""
    cfg, processor = run.config, run.parts.processor
    rows = drift_rows(batch.is_padding, cfg.trainer.drift_fraction, cfg.trainer.seed, step)
    trainer = trainer_logprobs(run.actor, batch, rows, old_logprobs, eos_token_id=processor.eos_token_ids[0],
                               pad_token_id=processor.pad_token_id)
    write_step(run.output_dir, step, drift_records(batch, rows, trainer, step=step, engine_version=engine_version,
                                                   max_staleness=cfg.derived.max_staleness,
                                                   temperature=cfg.rollout.temperature))


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
    if run.probe is not None:  # the engine's starting weights against the trainer's: what later probes start from,
        with timer("weight_probe"):  # and the start-up check that the engine computes the trainer's model at all
            probed = run.probe(run.actor, run.parts.backend, 0, run.engine_version, at_start=True)
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
    """A checkpoint of step run.step (HF-format weights, trainer state, what the placement and the agent loop keep)."""
    model = run.actor.full_model()  # at dp > 1 gathered from the shards
    info = {"data": run.data_state(), "total_steps": run.total_steps, "config": to_dict(run.config)}
    if run.parts.agent is not None:
        # Prompts taken from the sampler but not started yet; the carried groups go into files of their own.
        info.update(prompt_queue=list(run.prompts.pending), agent_carried_groups=len(run.parts.agent.carried))
    if run.probe is not None:  # the last probe in sync: what the next probe is judged against
        info["weight_probe"] = run.probe.state_dict()
    agent, placement_writer = run.parts.agent, run.placement.checkpoint_writer()

    def write_extra(folder: Path) -> None:  # the LoRA adapter, the agent's carried groups, the async buffer
        run.actor.save_adapter(folder)
        if agent is not None:
            agent.save_carried(folder)
        if placement_writer is not None:
            placement_writer(folder)

    path = save_checkpoint(
        run.output_dir, run.step, model, run.config.actor.model_path,
        trainer_state={"actor": run.actor.state_dict(), "rng": rng_state()}, info=info,
        keep=run.config.trainer.max_ckpt_to_keep, write_extra=write_extra)
    logger.info("saved step %d: %s", run.step, path)
    return path


def validate(run: Run) -> dict[str, float]:
    """Validation of the weights the engine holds now (run.step's)."""
    return run_validation(run.parts, step=run.step).metrics
