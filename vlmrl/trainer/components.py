"""A run's components built from its config, shared by the fit loop and validation (`RunComponents`: the
processor, the reward function, the validation set, the rollout backend, the agent loop), and how each is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmrl.agent.loop import AgentLoop
from vlmrl.config import Config
from vlmrl.data.dataset import RLDataset
from vlmrl.processors.qwen_vl import Processor, load_processor
from vlmrl.rewards.base import RewardFn
from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.registry import start_backend

if TYPE_CHECKING:
    from vlmrl.distributed.group import ClusterSpec


@dataclass
class RunComponents:
    """What a run (training, or validate-only) generates and scores with; built once, closed once."""

    config: Config
    processor: Processor
    """The run's model's processor with the data section's settings: builds every request."""
    reward_fn: RewardFn
    backend: RolloutBackend
    """The rollout backend (one engine, or the Ray workers' colocated engines)."""
    val_data: RLDataset | None = None
    """The validation set (data.val_files); None = no validation."""
    agent: AgentLoop | None = None
    """The multi-turn loop over `backend` when agent.enable: training and validation rollouts go through it."""

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()  # releases the tools of carried trajectories before the backend goes
        self.backend.close()


def load_run_processor(config: Config) -> Processor:
    """The processor of the run's model, with the data section's image and prompt-length settings."""
    return load_processor(config.actor.model_path, config.data)


def start_run_backend(config: Config, name: str | None = None, model_path: str | None = None,
                      colocated: bool = False) -> RolloutBackend:
    """The run's rollout backend (rollout.name, or `name`) on the actor's model (or `model_path`, e.g. a checkpoint
    folder), sized for the longest request (`config.derived.max_model_len`); `colocated`: a training actor shares
    its device (the engine then frees its memory while the actor trains, on a GPU, by default)."""
    return start_backend(config.rollout, model_path or config.actor.model_path, name=name, seed=config.trainer.seed,
                         max_model_len=config.derived.max_model_len, lora=config.actor.lora, colocated=colocated)


def start_agent(config: Config, backend: RolloutBackend, processor: Processor) -> AgentLoop:
    """The run's multi-turn loop (agent section) over `backend`, within the data section's prompt/response lengths."""
    return AgentLoop(backend, processor, config.agent, prompt_length=config.data.max_prompt_length,
                     response_length=config.data.max_response_length)


def start_rollout_workers(config: Config, start_path: str | None):
    """The asynchronous placement's rollout workers (trainer.async_rollout.rollout_workers), their engines started
    on `start_path` (a checkpoint) or the actor's model."""
    from vlmrl.distributed.rollout_workers import RemoteEngines, RolloutWorkerSpec

    t = config.trainer
    spec = RolloutWorkerSpec(config.rollout, start_path or config.actor.model_path,
                             max_model_len=config.derived.max_model_len, seed=t.seed, lora=config.actor.lora,
                             torch_threads=t.torch_threads)
    return RemoteEngines(spec, workers=t.async_rollout.rollout_workers, restarts=t.async_rollout.worker_restarts,
                         first_device=config.derived.world_size)


def run_cluster(config: Config) -> ClusterSpec:
    """Where the run's training workers run: trainer.n_gpus_per_node x trainer.nnodes, engines per
    trainer.engine_placement."""
    from vlmrl.distributed.group import ClusterSpec

    t = config.trainer
    return ClusterSpec(n_gpus_per_node=t.n_gpus_per_node, nnodes=t.nnodes, engine_placement=t.engine_placement)
