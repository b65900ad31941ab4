"""A run's components built from its config, shared by the fit loop and validation (`RunComponents`: the
processor, the reward (its function, worker processes and judge), the validation set, the rollout backend, the agent
loop, a distillation teacher's engine), and how each is built: every backend a run starts (one engine, the Ray
workers' colocated engines, rollout workers of their own) starts from the options `run_backend_options` builds, and
the teacher's engine from the same rollout section (`teacher_backend_options`).

`vlmrl.distributed` is imported only where Ray workers start: the single-process trainer never needs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vlmrl.agent.loop import AgentLoop
from vlmrl.config import Config
from vlmrl.data.dataset import RLDataset
from vlmrl.processors.base import Processor
from vlmrl.processors.loading import load_processor
from vlmrl.rewards.scoring import RewardScorer
from vlmrl.rollout.base import BackendOptions, RolloutBackend
from vlmrl.rollout.registry import backend_options, get_backend

if TYPE_CHECKING:
    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.group import ClusterSpec, DistributedActor
    from vlmrl.distributed.layout import EngineLayout
    from vlmrl.distributed.rollout_workers import RemoteEngines
    from vlmrl.distributed.worker import WorkerSpec
    from vlmrl.trainer.teacher_engine import EngineTeacher

logger = logging.getLogger(__name__)


@dataclass
class RunComponents:
    """What a run (training, or validate-only) generates and scores with; built once, closed once."""

    config: Config
    processor: Processor
    """The run's model's processor with the data section's settings: builds every request."""
    reward: RewardScorer
    """The reward function with the processes it scores through (reward workers, the judge): closed with the run."""
    backend: RolloutBackend
    """The rollout backend (one engine, or the Ray workers' colocated engines)."""
    val_data: RLDataset | None = None
    """The validation set (data.val_files); None = no validation."""
    agent: AgentLoop | None = None
    """The multi-turn loop over `backend` when agent.enable: training and validation rollouts go through it."""
    teacher: EngineTeacher | None = None
    """The distillation teacher's engine (algorithm.distill.teacher_engine other than trainer), else None."""

    def close(self) -> None:
        """Closes the agent loop, the backend, the teacher's engine and the reward (each also when closing an
        earlier one fails)."""
        try:
            if self.agent is not None:
                self.agent.close()  # releases the tools of carried trajectories before the backend goes
            self.backend.close()
        finally:
            try:
                if self.teacher is not None:
                    self.teacher.close()
            finally:
                self.reward.close()


def load_run_processor(config: Config) -> Processor:
    """The processor of the run's model, with the data section's image and prompt-length settings."""
    return load_processor(config.actor.model_path, config.data)


def run_backend_options(config: Config, name: str | None = None, colocated: bool = False) -> BackendOptions:
    """What the run's backend (rollout.name, or `name`) starts from: the rollout section, sized for the longest
    request (`config.derived.max_model_len`), seeded with trainer.seed, serving adapters where actor.lora syncs
    them (`vlmrl.rollout.registry.backend_options`); `colocated`: a training actor shares its device (the engine
    then frees its memory while the actor trains, on a GPU, by default)."""
    return backend_options(config.rollout, name or config.rollout.name, max_model_len=config.derived.max_model_len,
                           seed=config.trainer.seed, lora=config.actor.lora, colocated=colocated)


def start_run_backend(config: Config, name: str | None = None, model_path: str | None = None,
                      colocated: bool = False) -> RolloutBackend:
    """The run's rollout backend (rollout.name, or `name`) in this process, on the actor's model (or `model_path`,
    e.g. a checkpoint folder), started from `run_backend_options`."""
    name = name or config.rollout.name
    model_path = model_path or config.actor.model_path
    logger.info("starting rollout backend %s on %s", name, model_path)
    return get_backend(name, model_path, run_backend_options(config, name, colocated))


def teacher_backend_options(config: Config) -> BackendOptions:
    """What the distillation teacher's engine starts from: the run's rollout section (deadlines, limits,
    engine_kwargs) in algorithm.distill.teacher_dtype with teacher_gpu_memory_utilization, sized like the run's
    engine, no LoRA and no routing capture, releasing its memory while the actor trains where it can (a GPU), a vLLM
    engine allowed algorithm.distill.topk prompt logprobs per position (forward_kl_topk). Beside a vLLM student it
    runs its engine core in a process of its own: two engines in one process share vLLM's global parallel state
    (rollout.vllm.multiprocess null is in-process on a CPU)."""
    d, r = config.algorithm.distill, config.rollout
    beside_vllm = r.name == "vllm" and d.teacher_engine == "vllm" and r.vllm.multiprocess is None
    vllm_kwargs = dict(r.vllm.engine_kwargs)
    if d.estimator == "forward_kl_topk":  # vLLM refuses prompt_logprobs above max_logprobs (its default: 20)
        vllm_kwargs["max_logprobs"] = max(d.topk, vllm_kwargs.get("max_logprobs", 20))
    rollout = replace(r, dtype=d.teacher_dtype, gpu_memory_utilization=d.teacher_gpu_memory_utilization,
                      vllm=replace(r.vllm, capture_routing=False, engine_kwargs=vllm_kwargs,
                                   multiprocess=True if beside_vllm else r.vllm.multiprocess),
                      sglang=replace(r.sglang, capture_routing=False),
                      # the teacher's server: at teacher_url, or launched on a free port with a log of its own
                      server=replace(r.server, url=d.teacher_url, port=0, log_file=""))
    return backend_options(rollout, d.teacher_engine, max_model_len=config.derived.max_model_len,
                           seed=config.trainer.seed, colocated=True)


def start_teacher_engine(config: Config) -> EngineTeacher | None:
    """The distillation teacher's engine (algorithm.distill.teacher_engine = hf | vllm | sglang | sglang-server) on
    algorithm.distill.teacher, from `teacher_backend_options`; None when the teacher runs in the trainer (or there
    is none)."""
    from vlmrl.trainer.teacher_engine import EngineTeacher

    d = config.algorithm.distill
    if not d.enabled or d.teacher_engine == "trainer":
        return None
    options = teacher_backend_options(config)
    logger.info("starting the distillation teacher's engine %s on %s (%s)", d.teacher_engine, d.teacher,
                options.rollout.dtype)
    return EngineTeacher(get_backend(d.teacher_engine, d.teacher, options), d)


def start_agent(config: Config, backend: RolloutBackend, processor: Processor) -> AgentLoop:
    """The run's multi-turn loop (agent section) over `backend`, within the data section's prompt/response lengths."""
    return AgentLoop(backend, processor, config.agent, prompt_length=config.data.max_prompt_length,
                     response_length=config.data.max_response_length)


def start_rollout_workers(config: Config, start_path: str | None, source: DistributedActor | None = None
                          ) -> RemoteEngines:
    """The asynchronous placement's rollout workers (trainer.async_rollout.rollout_workers), their engines started
    on `start_path` (a checkpoint) or the actor's model. `source`: the training workers at dp > 1, whose rank 0
    sends the weights over the weight group itself (with weight_transfer collective)."""
    from vlmrl.distributed.rollout_actor import RolloutWorkerSpec
    from vlmrl.distributed.rollout_workers import RemoteEngines
    from vlmrl.distributed.worker import EngineSpec

    t = config.trainer
    engine = EngineSpec(config.rollout.name, start_path or config.actor.model_path, run_backend_options(config))
    a = t.async_rollout
    return RemoteEngines(RolloutWorkerSpec(engine, torch_threads=t.torch_threads, weight_transfer=a.weight_transfer,
                                           group_port=a.weight_group_port),
                         workers=a.rollout_workers, restarts=a.worker_restarts,
                         driver_trains=config.derived.world_size == 1, source=source)


def run_layout(config: Config) -> EngineLayout:
    """Which process holds which trainer shard and which engine rank, from the run's sizes (before any process
    starts): the record `setup_run` builds the run from and prints, and the memory plan reads."""
    from vlmrl.distributed.layout import EngineLayout

    t, r = config.trainer, config.rollout
    return EngineLayout(dp=config.derived.world_size, tp=r.tensor_parallel_size, engine=r.name,
                        placement=t.engine_placement,
                        rollout_workers=t.async_rollout.rollout_workers if t.async_rollout.enable else 0)


def run_cluster(config: Config) -> ClusterSpec:
    """Where the run's training workers run: trainer.n_gpus_per_node x trainer.nnodes, engines per
    trainer.engine_placement."""
    from vlmrl.distributed.group import ClusterSpec

    t = config.trainer
    return ClusterSpec(n_gpus_per_node=t.n_gpus_per_node, nnodes=t.nnodes, engine_placement=t.engine_placement)


def training_worker_spec(config: Config, total_steps: int, init_path: str | None = None) -> WorkerSpec:
    """What every training worker builds: the actor from `actor.*`, its colocated engine from `rollout.*`
    (starting from the same weights as the actor: the checkpoint when resuming)."""
    from vlmrl.distributed.worker import EngineSpec, WorkerSpec

    name = config.rollout.name
    if name == "sglang-server":
        raise ValueError("rollout.name=sglang-server runs outside the workers; colocated engines are hf, vllm or "
                         "sglang")
    # with LoRA the engines start on the base (an adapter applies to it); a resumed run syncs the policy after start
    start = config.actor.model_path if config.actor.lora.enabled else init_path or config.actor.model_path
    engine = EngineSpec(name, start, run_backend_options(config, colocated=True))
    return WorkerSpec(actor=config.actor, temperature=config.rollout.temperature, init_path=init_path,
                      total_steps=total_steps, engine=engine, distill=config.algorithm.distill,
                      torch_threads=config.trainer.torch_threads, timeout_s=config.rollout.timeout_s)


def start_distributed(config: Config, total_steps: int, init_path: str | None = None, engines: bool = True
                      ) -> tuple[DistributedActor, ColocatedEngines | None]:
    """Start trainer.n_gpus_per_node x trainer.nnodes training workers (joining the Ray cluster at $RAY_ADDRESS when
    set) and return the actor and its colocated engines as a rollout backend; close the backend to stop everything.
    `engines=False`: the workers only train (the run's engines are rollout workers of their own); the backend is
    then None and the actor is closed by itself."""
    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.group import DistributedActor

    spec = training_worker_spec(config, total_steps, init_path)
    if not engines:
        spec = replace(spec, engine=None)
    actor = DistributedActor(run_cluster(config), spec, mini_batch_samples=config.derived.mini_batch_samples,
                             timeout_s=config.rollout.timeout_s,
                             # worker setup starts the engine too: its deadline plus the actor's loading
                             startup_timeout_s=config.rollout.start_timeout_s + 300.0)
    return actor, ColocatedEngines(actor) if engines else None
