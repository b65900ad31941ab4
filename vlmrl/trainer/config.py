"""Trainer configuration (the run config's `trainer` section): the loop, validation, checkpoints, logging, and the
devices it runs on (trainer.n_gpus_per_node x trainer.nnodes, as in verl; more than one runs Ray workers with FSDP2,
`vlmrl.distributed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

LOGGERS = ("console", "tensorboard", "wandb")
ENGINE_PLACEMENTS = ("worker", "node")
PROBE_ACTIONS = ("warn", "error")


@dataclass
class AsyncRolloutConfig:
    """The asynchronous placement (`vlmrl.trainer.async_rollout`): the engine generates the next steps' batches on
    a rollout thread of its own while the trainer updates on the last one."""

    enable: bool = False
    """False: the synchronous loop (rollout, then update, then sync, one after another). True: the asynchronous
    placement."""
    max_staleness: int = 1
    """How many optimizer steps older than the trainer's weights the weights a consumed batch was sampled with may be:
    a batch for step s starts only once the engine holds step s - 1 - max_staleness's weights or newer. 0 = each
    batch from the weights just synced: the synchronous run's schedule, and its metrics exactly. A trainer slower
    than the engine runs at the bound by design (most batches max_staleness steps old)."""
    buffer_steps: int = 2
    """Batches the rollout thread may hold ready ahead of the trainer."""
    rollout_workers: int = 0
    """0: the engine runs in the trainer's process (its rollout thread calls it there). N >= 1: N rollout workers,
    each an engine at rollout.tensor_parallel_size k in a Ray actor of its own, placed by a placement group of k
    CPUs (k GPUs on a GPU cluster) on any node with room; the batch's requests split between them
    (`vlmrl.distributed.rollout_workers`)."""
    weight_transfer: str = "auto"
    """How a weight sync reaches the rollout workers (`vlmrl.distributed.weight_transfer`): `collective` (the trainer
    broadcasts each bucket over a gloo/NCCL group straight into every engine rank, through the engines' own update
    APIs; nothing stored), `object_store` (each bucket put into Ray's object store once and read by every worker; the
    last sync kept there for a restarted worker), `auto` (collective where the engines join a group: vllm, sglang)."""
    weight_group_port: int = 0
    """The port the weight group's sender listens on for its rendezvous (the driver at dp = 1, training rank 0 at
    dp > 1; reachable from the workers' nodes); 0 = a free one each time a group is formed."""
    interrupt_tokens: int = 0
    """0: a batch in flight when a weight sync comes finishes on the old weights first (its version says so). N > 0:
    the rollout generates in segments of N tokens and a sync (or probe, or validation) interrupts the batch in
    flight at its next segment boundary; its unfinished samples go on with the new weights, each token's logprob
    the one its weights gave (`vlmrl.rollout.segments`). A sample's version is its first segment's."""
    staged_sync: bool = False
    """False: after each update the trainer waits for the engine (the batch in flight, then the weight load and the
    weights probe). True: the trainer stages a copy of its new weights (in the engine's dtype) and goes on to its
    next step; the rollout thread loads them before its next batch, or at the next segment boundary with
    interrupt_tokens (what RLinf calls `sync_weight_no_wait`). The steps that validate or save, and the last one,
    still sync and probe as False does, so validation, checkpoints and the weights probe see a landed sync. Costs a
    copy of the weights while one is staged. Not with actor.lora."""
    worker_restarts: int = 1
    """How many times in a run a rollout worker that died is started again (given the last synced weights, its
    requests generated again; with the collective weight transfer, a worker that died between syncs gets them at the
    next sync and its requests go to the workers that hold them); after that a worker's death stops the run with an
    error naming it."""

    def problems(self) -> list[str]:
        out = []
        if self.max_staleness < 0:
            out.append(f"trainer.async_rollout.max_staleness={self.max_staleness} must be >= 0")
        if self.buffer_steps < 1:
            out.append(f"trainer.async_rollout.buffer_steps={self.buffer_steps} must be >= 1")
        if self.weight_transfer not in ("auto", "collective", "object_store"):
            out.append(f"trainer.async_rollout.weight_transfer={self.weight_transfer!r}: choose auto, collective or "
                       "object_store")
        if not 0 <= self.weight_group_port < 65536:
            out.append(f"trainer.async_rollout.weight_group_port={self.weight_group_port} must be a port (0 = any "
                       "free one)")
        if self.rollout_workers < 0 or self.worker_restarts < 0 or self.interrupt_tokens < 0:
            out.append(f"trainer.async_rollout.rollout_workers={self.rollout_workers}, worker_restarts="
                       f"{self.worker_restarts} and interrupt_tokens={self.interrupt_tokens} must be >= 0")
        return out


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    """Passes over the training data (ignored when total_steps is set)."""
    total_steps: int | None = None
    """Training steps to run; None = total_epochs worth."""
    val_before_train: bool = True
    """Validate the initial weights (step 0)."""
    test_freq: int = 5
    """Validate every this many steps (and after the last); <= 0 = only val_before_train."""
    val_only: bool = False
    """Validate-only mode: no optimizer, weights untouched; writes metrics and the per-sample artifact."""
    save_freq: int = -1
    """Save a checkpoint every this many steps (and after the last); <= 0 = never."""
    max_ckpt_to_keep: int | None = 2
    """Keep the newest K checkpoints; None = keep all."""
    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir when there is one."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, checkpoints, artifacts and plots go."""
    seed: int = 1
    """Seeds data order, sampling and torch."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks besides metrics.jsonl (always written): console, tensorboard, wandb."""
    project_name: str = "vlmrl"
    """W&B project."""
    experiment_name: str = "grpo"
    """W&B run name."""
    format_warmup_steps: int = 0
    """Supervised steps on RANDOM answer labels before RL, teaching only the answer format (never the answers):
    a random-init model otherwise never produces a gradable answer. Needs a task with a closed answer set."""
    format_warmup_lr: float = 1e-3
    """Learning rate of the format warm-up (its own AdamW, discarded afterwards)."""
    format_warmup_batch_size: int = 32
    """Prompts per format warm-up step."""
    torch_threads: int = 0
    """torch.set_num_threads; 0 leaves torch's default (1 is often fastest on small CPUs)."""
    n_gpus_per_node: int = 1
    """Training devices per node; more than one device in all runs Ray workers with FSDP2 (vlmrl.distributed)."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    device_peak_flops: float | None = None
    """Peak FLOP/s of one training device, for throughput/mfu_actor: its dense bf16 tensor peak (989e12 for an H100
    SXM or H200). None = looked up by CUDA device name (vlmrl.trainer.throughput.DEVICE_PEAK_FLOPS); on a CPU or an
    unknown device no MFU is logged unless this is set."""
    drift_fraction: float = 0.05
    """Share of each step's samples (at least one; 0 = off) whose engine and trainer logprobs are kept in
    OUTPUT_DIR/drift/step_<N>.jsonl, for `python -m vlmrl.alignment.drift` (mismatch per step, jumps and their
    cause). Drawn by (seed, step), so a rerun or a resumed run keeps the same samples."""
    weight_probe_tokens: int = 16
    """After every weight sync (and before the first step) the engine answers the first training row greedily for
    this many tokens and the trainer scores them: whether the engine holds the trainer's weights, a sync that did not
    land or landed partly (`vlmrl.alignment.weight_probe`; OUTPUT_DIR/drift/probe_<N>.json, weight_probe/* metrics).
    0 = off."""
    weight_probe_action: str = "warn"
    """What a failed probe does: `warn` (a warning; the drift tool shows it) or `error` (the run stops, naming the
    step)."""
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    """The asynchronous placement: rollout and update at the same time, within a staleness bound."""
    engine_placement: str = "worker"
    """With several devices, where the colocated rollout engines run: `worker` = one per training worker, `node` =
    one per node (on its first worker; the node's requests go to it)."""

    @property
    def world_size(self) -> int:
        return self.n_gpus_per_node * self.nnodes

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.total_steps is not None and self.total_steps < 1:
            out.append(f"trainer.total_steps={self.total_steps} must be >= 1 (or null)")
        if self.total_epochs < 1:
            out.append(f"trainer.total_epochs={self.total_epochs} must be >= 1")
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            out.append(f"trainer.max_ckpt_to_keep={self.max_ckpt_to_keep} must be >= 1 (or null to keep all)")
        unknown_loggers = [name for name in self.logger if name not in LOGGERS]
        if unknown_loggers:
            out.append(f"trainer.logger has unknown sink(s) {unknown_loggers}; choose from {list(LOGGERS)}")
        if self.format_warmup_steps < 0:
            out.append(f"trainer.format_warmup_steps={self.format_warmup_steps} must be >= 0")
        if self.n_gpus_per_node < 1 or self.nnodes < 1:
            out.append("trainer.n_gpus_per_node and trainer.nnodes must be >= 1")
        if self.device_peak_flops is not None and not self.device_peak_flops > 0:
            out.append(f"trainer.device_peak_flops={self.device_peak_flops} must be > 0 (e.g. 989e12 for an H100) or "
                       "null (from the device's name)")
        if not 0.0 <= self.drift_fraction <= 1.0:
            out.append(f"trainer.drift_fraction={self.drift_fraction} must be in [0, 1] (0 = no drift samples)")
        if self.weight_probe_tokens < 0:
            out.append(f"trainer.weight_probe_tokens={self.weight_probe_tokens} must be >= 0 (0 = no weight probe)")
        if self.weight_probe_action not in PROBE_ACTIONS:
            out.append(f"trainer.weight_probe_action={self.weight_probe_action!r} is not one of {list(PROBE_ACTIONS)}")
        out += self.async_rollout.problems()
        if self.engine_placement not in ENGINE_PLACEMENTS:
            out.append(f"trainer.engine_placement={self.engine_placement!r} is not one of {list(ENGINE_PLACEMENTS)}")
        return out
