"""The GRPO fit loop: each step is a sequence of named, timed phases.

    rollout -> reward -> old_logprobs (when the batch gets more than one optimizer step) -> ref_logprobs (KL only)
            -> advantages -> update -> weight_sync -> [validate]

Everything else (setup, resume, checkpoints, validate-only mode) is a small function around it. Step numbering: the
initial weights are step 0 (validated when trainer.val_before_train); step k is the state after k updates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmrl.algorithms.grpo import group_advantages
from vlmrl.atomic import write_text_atomically
from vlmrl.batch import batch_metrics
from vlmrl.config import Config, to_dict, to_yaml
from vlmrl.data import BatchSampler, RLDataset, build_requests, load_dataset
from vlmrl.processors import Processor
from vlmrl.rewards import TIMEOUT_KEY, RewardFn, close_reward_workers
from vlmrl.rollout import RolloutBackend
from vlmrl.trainer.actor import Actor
from vlmrl.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint_state,
    refuse_earlier_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    tidy_checkpoints,
)
from vlmrl.trainer.experience import (
    PromptQueue,
    agent_train_batch,
    build_processor,
    build_train_batch,
    load_reward_fn,
    score,
    start_agent,
    start_backend,
)
from vlmrl.trainer.metrics import METRICS_FILE, PLOT_FILE, MetricsLogger, plot_curves, truncate_after
from vlmrl.trainer.validation import load_val_dataset, run_validation
from vlmrl.trainer.warmup import format_warmup
from vlmrl.types import SamplingParams, TrainBatch

if TYPE_CHECKING:
    from vlmrl.agent import AgentLoop

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

    def metrics(self) -> dict[str, float]:
        return {**{f"timing/{k}": v for k, v in self.seconds.items()}, "timing/step": time.perf_counter() - self.start}


@dataclass
class Run:
    """Everything a training run holds between steps."""

    config: Config
    output_dir: Path
    processor: Processor
    train_data: RLDataset
    val_data: RLDataset | None
    sampler: BatchSampler
    reward_fn: RewardFn
    actor: Actor
    """The single-process Actor, or vlmrl.distributed's DistributedActor (same methods) when dp_size > 1."""
    backend: RolloutBackend
    sink: MetricsLogger
    total_steps: int
    sync_weights: Callable[[], None]
    """Actor weights -> rollout engines (and every cache holding old-weight results)."""
    dp_size: int = 1
    step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    agent: AgentLoop | None = None
    """The multi-turn loop over `backend` when agent.enable (training and validation rollouts go through it)."""
    prompts: PromptQueue | None = None
    """Prompt indices for the agent loop, which may ask for more or fewer than a batch (partial rollout)."""

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()  # releases the tools of carried trajectories before the backend goes
        self.backend.close()
        self.sink.close()
        close_reward_workers()


# ---------------------------------------------------------------------------------------------------- the loop


def fit(config: Config) -> dict[str, float]:
    """Train (or, with trainer.val_only, only validate). Returns the last logged metrics."""
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
        while run.step < run.total_steps:
            metrics = train_step(run)
            run.step += 1
            if _due(config.trainer.test_freq, run.step, run.total_steps) and run.val_data is not None:
                start = time.perf_counter()
                metrics.update(validate(run))
                metrics["timing/validate"] = time.perf_counter() - start
            run.sink.log(run.step, metrics)
            run.last_metrics = metrics
            progress.update(1)
            progress.set_postfix({short: round(metrics[key], 3) for key, short in
                                  (("reward/mean", "reward"), ("val/accuracy", "val_acc")) if key in metrics})
            if _due(config.trainer.save_freq, run.step, run.total_steps):
                save(run)
        progress.close()
        plot = plot_curves(run.output_dir / METRICS_FILE, run.output_dir / PLOT_FILE)
        logger.info("done: %d steps; metrics %s; curves %s", run.step, run.output_dir / METRICS_FILE, plot)
        return run.last_metrics
    finally:
        run.close()


def train_step(run: Run) -> dict[str, float]:
    """One GRPO step on the next batch of prompts; returns its metrics (the caller logs them)."""
    cfg, step = run.config, run.step + 1
    timer = PhaseTimer()
    agent_metrics: dict[str, float] = {}
    if run.agent is not None:  # rollout and reward together: the loop pads each trajectory as it ends
        with timer("rollout"):
            batch, agent_metrics, failures, filtered = agent_train_batch(
                run.agent, run.processor, cfg, run.train_data, run.prompts, run.reward_fn, training_sampling(cfg, step),
                step, run.dp_size)
    else:
        with timer("rollout"):
            built = build_requests(run.processor, run.train_data, next(run.sampler))
            if not built.requests:
                raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
            results = run.backend.generate(built.requests, training_sampling(cfg, step))
        with timer("reward"):
            scores, parts, failures = score(run.reward_fn, built.requests, results, run.processor.tokenizer,
                                            cfg.rollout.n, cfg.reward)
            batch = build_train_batch(run.processor, cfg, built.requests, results, scores, parts,
                                      policy_version=step - 1, dp_size=run.dp_size)
        filtered = built.num_skipped
    old_logprobs = None  # one optimizer step on fresh samples: the update's own forward gives them (ratio 1)
    # Carried partial-rollout tokens came from older policies: the current weights are not the ones that sampled them,
    # so the trainer recomputes old logprobs with the weights about to be updated (verl's recompute).
    carries = cfg.agent.enable and cfg.agent.partial.enable
    if carries or not run.actor.skips_old_logprobs(len(batch)):
        with timer("old_logprobs"):
            old_logprobs, _ = run.actor.compute_logprobs(batch)
    ref_logprobs = None
    if cfg.actor.use_kl_loss:
        with timer("ref_logprobs"):
            ref_logprobs, _ = run.actor.compute_logprobs(batch, reference=True)
    with timer("advantages"):
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding,
                                      norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo)
    with timer("update"):
        actor_metrics = run.actor.update(batch, old_logprobs, advantages, ref_logprobs)
    with timer("weight_sync"):
        run.sync_weights()
    return {**batch_metrics(batch), **actor_metrics, **agent_metrics, **timer.metrics(),
            **step_metrics(batch, advantages, failures, filtered, run, timer)}


def step_metrics(batch: TrainBatch, advantages: torch.Tensor, failures: int, filtered: int, run: Run,
                 timer: PhaseTimer) -> dict[str, float]:
    """Metrics beyond batch_metrics and the actor's: reward failures and timeouts (timeouts are failures too),
    filtered prompts, groups with signal."""
    real = ~batch.is_padding
    tokens = float((batch.response_mask * real.unsqueeze(-1)).sum())
    return {
        "reward/failures": float(failures),
        "reward/timeouts": float(sum(extra.get(TIMEOUT_KEY, 0.0) for extra in batch.reward_extra)),  # padding rows: {}
        "batch/filtered_prompts": float(filtered),
        "batch/groups_with_signal": _share_of_groups_with_signal(batch, advantages),
        "epoch": float(run.sampler.epoch),
        "throughput/response_tokens_per_s": tokens / max(timer.metrics()["timing/step"], 1e-9),
    }


def _share_of_groups_with_signal(batch: TrainBatch, advantages: torch.Tensor) -> float:
    """Fraction of prompts whose samples got different rewards (only those carry a GRPO gradient)."""
    groups: dict[str, bool] = {}
    for i, uid in enumerate(batch.uids):
        if not batch.is_padding[i]:
            groups[uid] = groups.get(uid, False) or bool(advantages[i] != 0)
    return sum(groups.values()) / max(len(groups), 1)


def training_sampling(config: Config, step: int) -> SamplingParams:
    """Sampling of step `step`: seeded by (trainer.seed, step), so a resumed run draws what an uninterrupted one
    would."""
    r = config.rollout
    seed = (config.trainer.seed * 7_919 + step * 1_000_003) % (2**31)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=config.data.max_response_length, seed=seed)


def validate(run: Run) -> dict[str, float]:
    return run_validation(run.config, run.backend, step=run.step, processor=run.processor, dataset=run.val_data,
                          reward_fn=run.reward_fn, agent=run.agent).metrics


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
    processor = build_processor(config)
    train_data = load_dataset(d.train_files, "train", prompt_key=d.prompt_key, image_key=d.image_key,
                              synthetic_train_size=d.synthetic_train_size, synthetic_val_size=d.synthetic_val_size,
                              synthetic_seed=t.seed)
    val_data = load_val_dataset(config) if d.val_files else None
    sources = train_data.data_sources() + (val_data.data_sources() if val_data else [])
    reward_fn = load_reward_fn(config, sources)
    sampler = BatchSampler(len(train_data), d.train_batch_size, shuffle=d.shuffle, seed=t.seed)
    total_steps = t.total_steps or t.total_epochs * sampler.batches_per_epoch
    checkpoint = latest_checkpoint(output_dir) if t.resume else None
    init_path = str(checkpoint) if checkpoint else None
    dp_size = t.n_gpus_per_node * t.nnodes
    if dp_size > 1:  # Ray workers with FSDP2-sharded actors and colocated engines; the loop stays the same
        from vlmrl.distributed.launch import start_distributed

        actor, backend = start_distributed(config, total_steps, init_path)
        opened.append(backend.close)  # stops the workers too
        sync_weights = actor.sync_weights
    else:
        actor = Actor(config.actor, total_steps, config.actor.ppo_mini_batch_size * config.rollout.n,
                      temperature=config.rollout.temperature, init_path=init_path)
        # A resumed backend starts from the checkpoint folder (HF format): weights already in sync.
        backend = start_backend(config, model_path=init_path)
        opened.append(backend.close)

        def sync_weights() -> None:
            backend.update_weights(actor.named_tensors())
    step = 0
    if checkpoint is not None:
        state, info = load_checkpoint_state(checkpoint)
        actor.load_state_dict(state["actor"])
        set_rng_state(state["rng"])
        sampler.load_state_dict(info["data"])
        step = int(info["step"])
        logger.info("resuming from %s (step %d of %d)", checkpoint, step, total_steps)
        truncate_after(output_dir / METRICS_FILE, step)
    elif (output_dir / METRICS_FILE).exists():
        kept = output_dir / f"{METRICS_FILE}.{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(output_dir / METRICS_FILE, kept)
        logger.warning("%s exists but there is no checkpoint to resume from: starting over (old lines kept in %s)",
                       output_dir / METRICS_FILE, kept)
    from tqdm import tqdm

    sink = MetricsLogger(output_dir, t.logger, to_dict(config), t.project_name, t.experiment_name, console=tqdm.write)
    opened.append(sink.close)
    run = Run(config, output_dir, processor, train_data, val_data, sampler, reward_fn, actor, backend, sink,
              total_steps, sync_weights, dp_size, step)
    if config.agent.enable:
        run.agent, run.prompts = start_agent(config, backend, processor), PromptQueue(sampler)
        opened.append(run.agent.close)
        if checkpoint is not None:
            resume_agent(run, checkpoint, info)
    return run


def resume_agent(run: Run, checkpoint: Path, info: dict) -> None:
    """The agent loop's share of a checkpoint: prompts taken from the sampler but not started (not re-issued, not
    skipped), and the groups partial rollout carried into the next step, exactly where they parked."""
    if "prompt_queue" in info:
        run.prompts.pending = [int(i) for i in info["prompt_queue"]]
    else:  # written before checkpoints kept it: those prompts are skipped
        logger.warning("%s has no prompt-queue position (an older checkpoint): prompts drawn from the sampler but "
                       "not started before it was saved are skipped", checkpoint)
    run.agent.restore_carried(checkpoint)


def start_of_training(run: Run) -> None:
    """Step 0: the optional format warm-up (then a weight sync), then validation of the starting weights."""
    t = run.config.trainer
    metrics: dict[str, float] = {}
    if t.format_warmup_steps > 0:
        start = time.perf_counter()
        losses = format_warmup(run.actor, run.processor, run.train_data, run.config)
        run.sync_weights()
        metrics.update({"warmup/loss_first": losses[0], "warmup/loss_last": losses[-1],
                        "timing/format_warmup": time.perf_counter() - start})
    if t.val_before_train and run.val_data is not None:
        start = time.perf_counter()
        metrics.update(validate(run))
        metrics["timing/validate"] = time.perf_counter() - start
    if metrics:
        run.sink.log(0, metrics)
        run.last_metrics = metrics


def save(run: Run) -> Path:
    start = time.perf_counter()
    model = run.actor.model if isinstance(run.actor, Actor) else run.actor.full_model()  # gathered from the shards
    info = {"data": run.sampler.state_dict(), "total_steps": run.total_steps, "config": to_dict(run.config)}
    if run.agent is not None:
        # Prompts taken from the sampler but not started yet; the carried groups go into files of their own.
        info.update(prompt_queue=list(run.prompts.pending), agent_carried_groups=len(run.agent.carried))
    path = save_checkpoint(
        run.output_dir, run.step, model, run.config.actor.model_path,
        trainer_state={"actor": run.actor.state_dict(), "rng": rng_state()}, info=info,
        keep=run.config.trainer.max_ckpt_to_keep, write_extra=None if run.agent is None else run.agent.save_carried)
    logger.info("saved step %d in %.1f s", run.step, time.perf_counter() - start)
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
        result = run_validation(config, name, step=step, artifact_path=artifact)
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
