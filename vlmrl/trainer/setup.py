"""A run's setup: the process, every component built (engines, a distillation teacher's engine, actor, Ray workers,
the reward with its worker processes and judge) and the resume from the newest checkpoint, the inputs checked before
any engine starts; and the validate-only mode."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vlmrl.actor.base import PolicyActor
from vlmrl.actor.local import Actor
from vlmrl.alignment.drift_artifact import DRIFT_DIR, drop_steps_after
from vlmrl.atomic import write_text_atomically
from vlmrl.config import Config, to_dict, to_yaml
from vlmrl.data.dataset import BatchSampler, PromptQueue, RLDataset, build_requests, load_dataset, sequential_batches
from vlmrl.processors.base import Processor
from vlmrl.rewards.scoring import RewardScorer
from vlmrl.trainer.async_rollout import CONSUMED_FILE
from vlmrl.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint_state,
    refuse_earlier_checkpoints,
    set_rng_state,
    tidy_checkpoints,
)
from vlmrl.trainer.components import (
    RunComponents,
    load_run_processor,
    run_layout,
    start_agent,
    start_distributed,
    start_rollout_workers,
    start_run_backend,
    start_teacher_engine,
)
from vlmrl.trainer.engine_probe import WeightProbe
from vlmrl.trainer.metrics import METRICS_FILE, MetricsLogger, truncate_after
from vlmrl.trainer.placement import start_placement
from vlmrl.trainer.run import Run
from vlmrl.trainer.validation import load_val_dataset, validate_with

logger = logging.getLogger(__name__)


def setup_process(config: Config) -> None:
    if config.trainer.torch_threads > 0:
        torch.set_num_threads(config.trainer.torch_threads)
    torch.manual_seed(config.trainer.seed)
    Path(config.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    logger.info("torch %s, %d threads, pid %d, output %s", torch.__version__, torch.get_num_threads(), os.getpid(),
                config.trainer.output_dir)


def setup_run(config: Config) -> Run:
    """Build every component; resume from the newest complete checkpoint in output_dir when there is one. When a
    step fails, what was already started (engines, Ray workers, the reward's worker processes and judge) is closed
    before the error goes on."""
    opened: list[Callable[[], None]] = []
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
    reward = RewardScorer.start(config.reward, sources)  # its worker processes and judge: the run's, closed with it
    opened.append(reward.close)
    layout = run_layout(config)  # which process holds which trainer shard and which engine rank
    logger.info("layout:\n%s", layout.describe())
    actor: PolicyActor
    dp_size, workers = layout.dp, layout.rollout_workers
    if dp_size > 1 and workers > 0:  # Ray workers that only train, beside rollout workers of their own
        from vlmrl.distributed.group import ensure_ray

        ensure_ray(dp_size + workers)  # a local cluster: a CPU for each
        actor, _ = start_distributed(config, total_steps, init_path, engines=False)
        opened.append(actor.close)
        # rank 0 of the training workers sends each sync over the weight group: no full copy through the driver
        backend = start_rollout_workers(config, None if config.actor.lora.enabled else init_path, source=actor)
        backend.close_after.append(actor.close)  # the run closes its backend: the training workers go with it
        opened.append(backend.close)
    elif dp_size > 1:  # Ray workers with FSDP2-sharded actors and colocated engines; the loop stays the same
        actor, backend = start_distributed(config, total_steps, init_path)
        opened.append(backend.close)  # stops the workers too
    else:
        actor = Actor(config.actor, total_steps, config.derived.mini_batch_samples,
                      temperature=config.rollout.temperature, init_path=init_path, distill=config.algorithm.distill)
        # A resumed backend starts from the checkpoint folder (HF format): weights already in sync. With LoRA it
        # starts on the base model (an adapter applies to the base) and gets the policy's weights below.
        # asynchronous: the engine generates while the actor trains, so it never gives its memory back to it
        start_path = None if config.actor.lora.enabled else init_path
        if workers > 0:  # engines in processes of their own
            backend = start_rollout_workers(config, start_path)
        else:
            backend = start_run_backend(config, model_path=start_path, colocated=not t.async_rollout.enable)
        opened.append(backend.close)
    teacher = start_teacher_engine(config)  # after the student's engine: the order their memory is taken in
    if teacher is not None:
        opened.append(teacher.close)
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
    parts = RunComponents(config, processor, reward, backend, val_data, teacher=teacher)
    run = Run(config, output_dir, parts, train_data, sampler, actor, sink, total_steps, start_placement(config),
              dp_size, step, engine_version=step)  # the engine starts on the checkpoint's weights (or synced above)
    if t.weight_probe_tokens > 0:
        run.probe = WeightProbe.for_run(config, processor, train_data, output_dir)
        if checkpoint is not None and "weight_probe" in info:  # judge the next probe as the uninterrupted run does
            run.probe.load_state_dict(info["weight_probe"])
    if checkpoint is not None:  # the asynchronous placement's unconsumed batches
        run.placement.restore(run, checkpoint)
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


def validate_only(config: Config) -> dict[str, float]:
    """Validate `actor.model_path` with `rollout.name`: no actor, no optimizer, the weights are only read.
    Writes OUTPUT_DIR/validation_<backend>_step<N>.jsonl (the artifact) and a metrics.jsonl line."""
    output_dir = Path(config.trainer.output_dir)
    step = _checkpoint_step(config.actor.model_path)
    name = config.rollout.name
    artifact = output_dir / f"validation_{name}_step{step}.jsonl"
    result = validate_with(config, name, step=step, artifact_path=artifact)  # closes what it started
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
        return int(json.loads(state.read_text()).get("step", 0))
    return 0
