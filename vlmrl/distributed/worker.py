"""The training worker: one Ray actor per device, holding its shard of the actor and (optionally) a rollout engine.

The driver (`vlmrl.distributed.group.DistributedActor`) creates one `TrainWorker` per placement-group bundle, gives
each its rank, and from then on calls the same method on every worker at once: the sharded forwards, backwards and
weight gathers inside are collectives, so every rank must run the same calls with the same number of rows.

Generation is the exception: engines run independently (no collectives), on the workers that host one.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vlmrl.actor.config import ActorConfig
from vlmrl.algorithms.config import DistillConfig
from vlmrl.distributed.layout import EngineLayout
from vlmrl.rollout.base import BackendOptions
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams, TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """How a worker builds its rollout engine (`vlmrl.rollout.registry.get_backend(name, model_path, options)`): a
    training worker's colocated one, or a rollout worker's (`vlmrl.distributed.rollout_workers`)."""

    name: str
    """Backend: hf, vllm, sglang (colocated), or any of `vlmrl.rollout.config.BACKENDS` in a rollout worker."""
    model_path: str
    """Weights the engine starts from (then synced from the actor)."""
    options: BackendOptions
    """What the backend starts from: the run's rollout section and what the run derives, built once per run
    (`vlmrl.trainer.components.run_backend_options`). A colocated engine started to release its memory
    (rollout.vllm.enable_sleep_mode, rollout.sglang.enable_memory_saver: on by default on a GPU) sleeps while the
    actor trains and wakes for the weight sync and the next generate."""


@dataclass
class WorkerSpec:
    """What every training worker is built from (the same on all ranks)."""

    actor: ActorConfig
    """The actor's settings (model, optimizer, micro-batch size...)."""
    temperature: float = 1.0
    """Sampling temperature: logprobs are of softmax(logits / temperature)."""
    init_path: str | None = None
    """Start the policy from these weights (a checkpoint) instead of actor.model_path."""
    total_steps: int = 1
    """Training steps: the length of the lr schedule (`vlmrl.actor.policy.lr_lambda`, the single-process actor's)."""
    engine: EngineSpec | None = None
    """The colocated rollout engine; None = this group only trains."""
    torch_threads: int = 0
    """torch.set_num_threads in the worker; 0 = torch's default."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective that waits longer (a rank that died or took another path) fails."""
    distill: DistillConfig | None = None
    """On-policy distillation: with a teacher, every rank holds its FSDP shard of it, as of the reference."""


class TrainWorker:
    """One rank. Methods are called by the driver through Ray; see the module docstring."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        if spec.torch_threads > 0:
            torch.set_num_threads(spec.torch_threads)
        self.rank, self.world_size = -1, 0
        self.actor = None
        self.engine = None
        self.shm_ident = ""  # an spmd vLLM engine's shared-memory name (setup)
        self.lora_sync = None  # with actor.lora: how this rank's engine gets the policy (merged or the adapter)
        self.weight_group = self.weight_pg = None  # rank 0 beside rollout workers: the weight group it sends over

    # ---- setup ------------------------------------------------------------------------------------------------------

    def node(self) -> str:
        """This worker's node id (the driver groups ranks by node)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> tuple[str, int]:
        """(ip, free port) for the process group's TCP rendezvous; asked of the worker that becomes rank 0."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world_size: int, master: tuple[str, int], layout: EngineLayout,
              shm_prefix: str = "vlmrl") -> dict[str, Any]:
        """Join the process group, load and shard the actor (and reference), start the engine if this rank hosts one
        (`layout`: which ranks do, at which tensor parallel size; `shm_prefix`: the names of an spmd engine's CPU
        shared memory begin with it). Called on every rank at once (the process-group join blocks until all have
        joined; an spmd engine's TP ranks build it together)."""
        from vlmrl.actor.policy import resolve_device
        from vlmrl.distributed.actor import ShardedActor
        from vlmrl.distributed.fsdp import init_process_group

        self.rank, self.world_size = rank, world_size
        device = resolve_device(self.spec.actor.device)
        if device.type == "cuda":  # Ray shows each worker only its own GPU
            torch.cuda.set_device(0)
        init_process_group(rank, world_size, master[0], master[1], device, self.spec.timeout_s)
        self.actor = ShardedActor(self.spec.actor, world_size, self.spec.temperature, self.spec.init_path,
                                  self.spec.total_steps, distill=self.spec.distill)
        if self.actor.peft_config is not None:
            from vlmrl.actor.lora import LoraSync

            self.lora_sync = LoraSync(self.spec.actor.lora, self.actor.model)
        if rank in layout.hosts and self.spec.engine is not None:
            from vlmrl.rollout.registry import get_backend

            engine = self.spec.engine
            options = replace(engine.options, spmd=layout.spmd,
                              cpu_binding=layout.cpu_binding(rank, os.cpu_count() or 1) if layout.tp > 1 else "")
            if layout.spmd:  # vLLM's external launcher reads its rank from the environment (torchrun's variables)
                # (a GPU worker sees only its own device: local rank 0). On a CPU its TP communicator's shared memory
                # gets a name of this group's own (`vlmrl.rollout.vllm.SHM_NAME_ENV`)
                self.shm_ident = f"{shm_prefix}-g{layout.group_of(rank)}"
                os.environ.update(RANK=str(rank), LOCAL_RANK="0" if device.type == "cuda" else str(rank),
                                  WORLD_SIZE=str(world_size), MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
                                  VLMRL_VLLM_SHM_NAME=self.shm_ident)
            self.engine = get_backend(engine.name, engine.model_path, options)
        logger.info("rank %d/%d ready (pid %d, engine: %s)", rank, world_size, os.getpid(),
                    self.spec.engine.name if self.engine else "none")
        return {"rank": rank, "pid": os.getpid(), "engine": self.engine is not None,
                "engine_dtype": self.engine.dtype if self.engine is not None else None}

    # ---- training (collectives: every rank, same calls) --------------------------------------------------------------

    def compute_logprobs(self, batch: TrainBatch, reference: bool, with_entropy: bool, record_routing: bool = False,
                         teacher: bool = False):
        """(logprobs, entropy, routes): routes are the rows' recorded MoE routing (`batch.routed_experts` after a
        recording pass, else None), for the driver to hand back with each row's update shard. `teacher`: the
        distillation teacher's logprobs (its shards' forward, a collective like the reference's)."""
        self._rest_engine()
        logprobs, entropy = self.actor.compute_logprobs(batch, reference=reference, with_entropy=with_entropy,
                                                        record_routing=record_routing, teacher=teacher)
        return logprobs, entropy, batch.routed_experts if record_routing else None

    def teacher_top_logprobs(self, batch: TrainBatch, k: int):
        """The teacher's (logprobs, top-k logprobs, top-k ids) of this rank's rows (its shards' forward, a
        collective like compute_logprobs')."""
        self._rest_engine()
        return self.actor.teacher_top_logprobs(batch, k)

    def update_shard(self, shard, old_from_engine: bool = False) -> dict[str, float]:
        self._rest_engine()
        return self.actor.update_shard(shard, old_from_engine)

    def set_temperature(self, temperature: float) -> None:
        self.actor.set_temperature(temperature)

    def forward_dtype(self) -> torch.dtype:
        return self.actor.forward_dtype()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights (HF names) on rank 0, None elsewhere; every rank must call it."""
        tensors = {}
        for name, tensor in self.actor.named_tensors():
            if self.rank == 0:
                tensors[name] = tensor.cpu().clone()
        if self.rank != 0:
            return None
        if self.lora_sync is not None:  # PeftModel names -> the merged HF model's
            from vlmrl.actor.lora import merged_tensors

            return dict(merged_tensors(tensors.items(), self.lora_sync.scaling))
        return tensors

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], object] | None:
        """With LoRA: (the adapter tensors in PEFT file names, the PEFT LoraConfig) on rank 0, None elsewhere;
        every rank must call it (the shards are gathered)."""
        from vlmrl.actor.lora import adapter_tensors

        named = [(n, t.cpu()) for n, t in self.actor.named_tensors() if ".lora_" in n and self.rank == 0]
        return (adapter_tensors(named), self.actor.peft_config) if self.rank == 0 else None

    def sync_weights(self) -> int:
        """Gather the full weights (every rank takes part) and load them into this rank's engine, if it has one,
        bucket by bucket (rollout.sync_bucket_mb): a tensor is gathered when its bucket is filled, so host memory
        holds about one bucket, not the model. Returns the number of tensors loaded (0 without an engine)."""
        if self.engine is None:
            self.gather_weights()
            return 0
        names = self.actor.weight_names()
        stream = self.actor.named_tensors()  # each tensor is an all-gather every rank joins
        try:
            if self.lora_sync is not None:  # merged (streamed, layer by layer) or the adapter, as for one process
                self.lora_sync.push(self.engine, stream, names=names)
            else:
                self.engine.update_weights(stream, names=names)
        finally:
            for _ in stream:  # an engine that failed half-way: the other ranks still gather every tensor
                pass
        return len(names)

    # ---- the weight group's sender (rank 0; dp > 1 beside rollout workers of their own) ------------------------------

    def weight_group_address(self, port: int) -> tuple[str, int]:
        """(this node's address, `port` or a port free here): where the weight group's rendezvous listens."""
        import ray

        from vlmrl.distributed.weight_transfer import listen_address

        return listen_address(ray.util.get_node_ip_address(), port)

    def join_weight_group(self, group) -> None:
        """Join the weight group as its rank 0, the sender (after leaving any group joined before)."""
        from vlmrl.rollout.weight_group import join_group

        self.leave_weight_group()
        self.weight_group, self.weight_pg = group, join_group(group, 0)

    def leave_weight_group(self) -> None:
        from vlmrl.rollout.weight_group import leave_group

        leave_group(self.weight_pg)
        self.weight_group = self.weight_pg = None

    def send_weights(self, recipe):
        """Rank 0: gather the full weights (every other rank runs `gather_weights` at once) and broadcast them over
        the weight group a bucket at a time, cut by `recipe` as the rollout backend cuts its syncs (a LoRA policy
        merged, as `full_state_dict` gives it). Yields each bucket's BucketMeta before its broadcast: the driver
        hands it to the receiving engines. Host memory holds about one bucket."""
        from vlmrl.rollout.weight_group import pack_bucket, send_bucket

        if self.weight_pg is None:
            raise RuntimeError(f"rank {self.rank} has joined no weight group")
        names = self.actor.weight_names()
        gathered = self.actor.named_tensors()  # each tensor is an all-gather every rank joins
        stream = gathered
        if self.lora_sync is not None:  # PeftModel names -> the merged HF model's, streamed layer by layer
            from vlmrl.actor.lora import merged_names, merged_tensors

            names, stream = merged_names(names), merged_tensors(gathered, self.lora_sync.scaling)
        try:
            for bucket in recipe.plan(stream, names).buckets:
                meta, flat = pack_bucket(bucket)
                del bucket
                yield meta
                send_bucket(self.weight_pg, flat, self.weight_group.backend)
        finally:
            for _ in gathered:  # a sync that failed half-way: the other ranks still gather every tensor
                pass

    def gather_weights(self) -> int:
        """Every rank but 0 during `send_weights`: join each tensor's all-gather. Returns the tensors gathered."""
        return sum(1 for _ in self.actor.named_tensors())

    def load_engine_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load weights given by the driver into this rank's engine (the generic `update_weights` path)."""
        if self.engine is None:
            return 0
        self.engine.update_weights(named)
        return len(named)

    def optimizer_state(self) -> dict | None:
        """Full optimizer + scheduler state on rank 0 (None elsewhere); every rank must call it."""
        state = self.actor.optimizer_state()
        return state if self.rank == 0 else None

    def load_optimizer_state(self, state: dict) -> None:
        self.actor.load_optimizer_state(state)

    # ---- generation (no collectives) ---------------------------------------------------------------------------------

    def engine_pids(self) -> list[int]:
        """The processes this rank's engine runs in besides the worker's own (SGLang's TP schedulers)."""
        return list(self.engine.engine_pids) if self.engine is not None else []

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} hosts no rollout engine")
        if not requests:
            return []
        return self.engine.generate(requests, sampling)  # awake until training starts: an agent step calls once a turn

    def _rest_engine(self) -> None:
        """Training is next: the engine gives its memory back to the actor until the next weight sync or generation
        (which wake it); a no-op for an engine that keeps its memory, and once per step."""
        if self.engine is not None:
            self.engine.sleep()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.shm_ident:  # the TP group's shared memory (its other ranks may have died without removing theirs)
            for path in Path("/dev/shm").glob(f"{self.shm_ident}-*"):
                path.unlink(missing_ok=True)
        if self.lora_sync is not None:
            self.lora_sync.close()
        self.leave_weight_group()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
