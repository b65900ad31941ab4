"""From a run config to a started `DistributedActor` and its colocated engines (what the fit loop needs).

    actor, backend = start_distributed(config, total_steps)           # trainer.n_gpus_per_node x trainer.nnodes ranks
    ...the fit loop, unchanged: backend.generate / actor.compute_logprobs / actor.update ...
    actor.sync_weights(backend)                                         # engines get the new weights in the workers
"""

from __future__ import annotations

from dataclasses import replace

from vlmrl.config import Config
from vlmrl.distributed.engines import ColocatedEngines
from vlmrl.distributed.group import ClusterSpec, DistributedActor
from vlmrl.distributed.worker import EngineSpec, WorkerSpec
from vlmrl.rollout.registry import backend_options


def worker_spec(config: Config, total_steps: int, init_path: str | None = None) -> WorkerSpec:
    """What every worker builds: the actor from `actor.*`, its engine from `rollout.*` (starting from the same
    weights as the actor: the checkpoint when resuming)."""
    name = config.rollout.name
    if name == "sglang-server":
        raise ValueError("rollout.name=sglang-server runs outside the workers; colocated engines are hf, vllm or "
                         "sglang")
    options = backend_options(config.rollout, name, max_model_len=config.derived.max_model_len,
                              seed=config.trainer.seed, lora=config.actor.lora, colocated=True)
    # with LoRA the engines start on the base (an adapter applies to it); a resumed run syncs the policy after start
    start = config.actor.model_path if config.actor.lora.enabled else init_path or config.actor.model_path
    engine = EngineSpec(name=name, model_path=start, options=options)
    return WorkerSpec(actor=config.actor, temperature=config.rollout.temperature, init_path=init_path,
                      total_steps=total_steps, engine=engine,
                      torch_threads=config.trainer.torch_threads, timeout_s=config.rollout.timeout_s)


def start_distributed(config: Config, total_steps: int, init_path: str | None = None,
                      cluster: ClusterSpec | None = None, engines: bool = True
                      ) -> tuple[DistributedActor, ColocatedEngines | None]:
    """Start trainer.n_gpus_per_node x trainer.nnodes workers (joining the Ray cluster at $RAY_ADDRESS when set)
    and return the actor and its engines as a rollout backend. Close the backend to stop everything. `engines=False`:
    the workers only train (the run's engines are rollout workers of their own); the backend is then None and the
    actor is closed by itself."""
    spec = worker_spec(config, total_steps, init_path)
    if not engines:
        spec = replace(spec, engine=None)
    t = config.trainer
    cluster = cluster or ClusterSpec(n_gpus_per_node=t.n_gpus_per_node, nnodes=t.nnodes,
                                     engine_placement=t.engine_placement)
    actor = DistributedActor(cluster, spec,
                             mini_batch_samples=config.derived.mini_batch_samples,
                             timeout_s=config.rollout.timeout_s,
                             # worker setup starts the engine too: its deadline plus the actor's loading
                             startup_timeout_s=config.rollout.start_timeout_s + 300.0)
    return actor, ColocatedEngines(actor) if engines else None
