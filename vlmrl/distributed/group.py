"""The driver side: a Ray placement group with one training worker per device, used like the single-process actor.

`DistributedActor` implements `vlmrl.actor.base.PolicyActor` as the single-process `vlmrl.actor.local.Actor` does
(compute_logprobs, update, sync_weights, full_model...), plus the colocated engines' generate, so the fit loop runs
unchanged on one device or many:

    actor = DistributedActor(ClusterSpec(n_gpus_per_node=8, nnodes=2), WorkerSpec(actor=config.actor, ...),
                             mini_batch_samples=ppo_mini_batch_size * n)
    results = actor.generate(requests, sampling)        # data-parallel over the engines, request-major
    batch = upsample_to_multiple(batch, required_batch_multiple(actor.dp_size, ...), ...)
    old, _ = actor.compute_logprobs(batch)               # each rank its equal slice, gathered back
    metrics = actor.update(batch, old, advantages)       # sharded update, loss over the GLOBAL token count
    actor.sync_weights(engines)                          # full weights gathered from the shards into each engine

Every call fans out to all workers at once and waits with a timeout; a worker that dies (Ray reports it; a
collective mismatch kills the process, it cannot be caught inside) ends the call with an error naming the step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vlmrl.actor.core import needs_old_logprobs
from vlmrl.actor.step_metrics import mean_metrics
from vlmrl.distributed.layout import EngineLayout
from vlmrl.distributed.sharding import logprob_row_blocks, update_shards
from vlmrl.distributed.worker import TrainWorker, WorkerSpec
from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.requests import numbered_engines, sample_seed
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams, TrainBatch
from vlmrl.utils.sequences import split_evenly

logger = logging.getLogger(__name__)

# Workers of a `ray start` cluster do not inherit the driver's environment: engine and collective settings travel along.
FORWARDED_ENV = ("VLLM_", "SGLANG_", "VLMRL_", "TOKENIZERS_", "OMP_", "HF_", "TRANSFORMERS_", "NCCL_", "GLOO_",
                  "TORCH_NCCL_", "CUDA_LAUNCH")
CPUS_PER_WORKER = 1  # the CPUs each worker's bundle reserves


@dataclass(frozen=True)
class ClusterSpec:
    """Where a `DistributedActor`'s workers run. A run builds it from its trainer section (n_gpus_per_node, nnodes,
    engine_placement), so that this package reads no trainer config."""

    n_gpus_per_node: int = 1
    """Training workers (one device each) per node."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    engine_placement: str = "worker"
    """Where the colocated rollout engines run: `worker` = one per training worker, `node` = one per node (on its
    first worker; the node's requests go to it)."""

    @property
    def world_size(self) -> int:
        """Training workers in all: the data-parallel ranks."""
        return self.n_gpus_per_node * self.nnodes


def ensure_ray(workers: int) -> None:
    """Connect to (or start) Ray once per process: the cluster at $RAY_ADDRESS (`auto` = the one started on this
    node with `ray start`), else a local one with a CPU per worker (`workers` of them)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        logger.info("joined the Ray cluster at %s: %s", address, ray.cluster_resources())
    else:
        ray.init(num_cpus=workers * CPUS_PER_WORKER, include_dashboard=False, log_to_driver=True)
        logger.info("started a local Ray cluster: %s", ray.cluster_resources())


class DistributedActor:
    """The actor sharded over `cluster.world_size` Ray workers, with their colocated rollout engines."""

    def __init__(self, cluster: ClusterSpec, spec: WorkerSpec, mini_batch_samples: int, timeout_s: float = 600.0,
                 startup_timeout_s: float = 300.0):
        """
        Args:
            cluster: how many workers on how many nodes, and where the engines run.
            spec: what each worker builds (actor config, engine, threads, timeout).
            mini_batch_samples: rows per optimizer step (actor.ppo_mini_batch_size x rollout.n); must divide by
                the world size.
            timeout_s: every call to the workers (and every collective inside them) must finish within this.
            startup_timeout_s: placement group ready and workers loaded within this.
        """
        import ray
        from ray.util.placement_group import placement_group

        if mini_batch_samples % cluster.world_size:
            raise ValueError(f"a mini-batch of {mini_batch_samples} samples (ppo_mini_batch_size x rollout.n) does "
                             f"not split over {cluster.world_size} ranks: make it a multiple of the world size")
        self.cluster, self.spec, self.mini_batch_samples = cluster, spec, mini_batch_samples
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.closed = False
        self.workers: list = []
        ensure_ray(cluster.world_size)
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"CPU": CPUS_PER_WORKER, **({"GPU": 1} if use_gpu else {})}
        self.placement = placement_group([dict(bundle) for _ in range(cluster.world_size)], strategy="PACK")
        try:
            ready, _ = ray.wait([self.placement.ready()], timeout=startup_timeout_s)
            if not ready:
                raise RuntimeError(f"Ray could not place {cluster.world_size} workers of {bundle} within "
                                   f"{startup_timeout_s:.0f}s; the cluster has {ray.cluster_resources()}. "
                                   "Start more nodes (`ray start --address=...`) or lower n_gpus_per_node/nnodes")
            self._start_workers(use_gpu)
        except BaseException:
            self._release()
            raise

    def _start_workers(self, use_gpu: bool) -> None:
        """One worker per bundle; ranks grouped by node (contiguous local ranks); join the group, load, shard."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cluster = self.cluster
        env = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV)}
        remote_cls = ray.remote(TrainWorker)
        workers = [
            remote_cls.options(
                num_cpus=CPUS_PER_WORKER, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
            ).remote(self.spec)
            for i in range(cluster.world_size)
        ]
        self.workers = workers  # released on failure from here on
        nodes = self._get([w.node.remote() for w in workers], "locating workers", self.startup_timeout_s)
        node_order = list(dict.fromkeys(nodes))
        order = sorted(range(len(workers)), key=lambda i: (node_order.index(nodes[i]), i))
        self.workers = [workers[i] for i in order]
        self.nodes = [nodes[i] for i in order]
        engine = self.spec.engine
        self.layout = EngineLayout(dp=self.dp_size, tp=engine.options.rollout.tensor_parallel_size if engine else 1,
                                   engine=engine.name if engine else None, placement=cluster.engine_placement,
                                   nodes=tuple(self.nodes))
        """Which rank holds which trainer shard and which engine rank (printed below)."""
        self.hosts = self.layout.hosts
        master = self._get([self.workers[0].rendezvous_address.remote()], "rendezvous", self.startup_timeout_s)[0]
        self.shm_prefix = f"vlmrl-{os.getpid()}-{master[1]}"
        """What an spmd engine's CPU shared memory is named by (/dev/shm; removed at close, dead workers' too)."""
        ready = self._get([w.setup.remote(rank, self.dp_size, master, self.layout, self.shm_prefix)
                           for rank, w in enumerate(self.workers)], "loading and sharding the actor",
                          self.startup_timeout_s)
        self.pids = [info["pid"] for info in ready]
        """Each rank's worker process."""
        self.engine_dtypes = sorted({info["engine_dtype"] for info in ready if info["engine_dtype"]})
        """The dtypes the workers' engines compute in, as they resolved them where they run (one, normally)."""
        logger.info("distributed actor: %d ranks on %d node(s), %s bundles; layout:\n%s", self.dp_size,
                    len(node_order), "GPU" if use_gpu else "CPU", self.layout.describe())

    @property
    def dp_size(self) -> int:
        return self.cluster.world_size

    # ---- calls to the workers ---------------------------------------------------------------------------------------

    def _get(self, refs: list, what: str, timeout_s: float | None = None) -> list[Any]:
        """ray.get with a timeout; a dead or timed-out worker becomes an error naming `what`."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"{what}: the training workers did not finish within {timeout:.0f}s (a rank that "
                               "took another path through the model waits in a collective until the group's "
                               "timeout)") from None
        except RayActorError as err:
            raise RuntimeError(f"{what}: a training worker died ({type(err).__name__}); see its log above. A "
                               "collective mismatch (ranks running different modules or sizes) kills the process"
                               ) from err

    def _each(self, method: str, per_rank_args: list[tuple], what: str) -> list[Any]:
        return self._get([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank_args)], what)

    # ---- the actor's interface --------------------------------------------------------------------------------------

    def _on_row_blocks(self, method: str, batch: TrainBatch, args: tuple, what: str
                       ) -> tuple[list[list[int]], list[Any], Any]:
        """`method` on every rank over an equal contiguous slice of the rows (its forwards are collectives): (the
        blocks, each rank's answer, a function that puts a list of per-rank tensors back into batch order)."""
        blocks = logprob_row_blocks(batch, self.dp_size, balanced=self.spec.actor.micro_batch_tokens > 0)
        parts = self._each(method, [(batch.select(rows), *args) for rows in blocks], what)
        order = torch.as_tensor([row for rows in blocks for row in rows], dtype=torch.long)

        def in_batch_order(per_rank: list[torch.Tensor]) -> torch.Tensor:
            gathered = torch.cat(per_rank)  # the ranks' precision: float32, or float64 for float64
            placed = torch.empty((len(batch), *gathered.shape[1:]), dtype=gathered.dtype)
            placed[order] = gathered
            return placed

        return blocks, parts, in_batch_order

    def teacher_top_logprobs(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sharded teacher's (B, R) logprobs of the sampled tokens and its (B, R, k) top-k logprobs and ids
        (algorithm.distill.estimator=forward_kl_topk), each rank scoring its slice of the rows; in batch order."""
        _, parts, in_batch_order = self._on_row_blocks("teacher_top_logprobs", batch, (k,), "teacher top-k logprobs")
        logprobs, values, ids = (in_batch_order(list(per_rank)) for per_rank in zip(*parts))
        return logprobs, values, ids

    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, with_entropy: bool = False,
                         record_routing: bool = False, teacher: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) logprobs (and optionally entropy) of the batch, each rank computing an equal contiguous slice.
        B must divide by dp_size (upsample with padding rows first). `record_routing` (the old-logprob pass of a MoE
        policy): each rank records its rows' routing and the rows' routes come back into `batch.routed_experts`
        (in batch order), so that `update` hands every row's routing to whichever rank updates that row. `teacher`:
        the distillation teacher's logprobs, sharded like the reference's."""
        blocks, parts, in_batch_order = self._on_row_blocks(
            "compute_logprobs", batch, (reference, with_entropy, record_routing, teacher),
            "teacher logprobs" if teacher else "reference logprobs" if reference else "logprobs")
        logprobs = in_batch_order([lp for lp, _, _ in parts])
        entropy = in_batch_order([ent for _, ent, _ in parts]) if with_entropy else None
        if record_routing and any(routes is not None for _, _, routes in parts):
            routed: list[torch.Tensor | None] = [None] * len(batch)
            for rows, (_, _, routes) in zip(blocks, parts):
                for row, route in zip(rows, routes or [None] * len(rows)):
                    routed[row] = route
            batch.routed_experts = routed
        return logprobs, entropy

    def set_temperature(self, temperature: float) -> None:
        """Every rank's logprobs from here on are of softmax(logits / temperature)."""
        self._each("set_temperature", [(temperature,)] * self.dp_size, "setting the temperature")

    def forward_dtype(self) -> torch.dtype:
        """What the ranks' forward computes in, as they resolved it on their devices (rank 0's)."""
        return self._get([self.workers[0].forward_dtype.remote()], "reading the actor's dtype")[0]

    def needs_old_logprobs(self, batch_rows: int) -> bool:
        """False when the batch gets exactly one optimizer step: the update forward's own logprobs are the old ones
        (the single-process actor's rule, `vlmrl.actor.core.needs_old_logprobs`)."""
        return needs_old_logprobs(self.spec.actor, batch_rows, self.mini_batch_samples)

    def update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
               old_from_engine: bool = False) -> dict[str, float]:
        """The policy-loss update over the batch, sharded: every rank takes its slice of each mini-batch, the loss is
        normalised by the global mini-batch's normaliser. Same arguments and metrics as `Actor.update`."""
        shards = update_shards(batch, old_logprobs, advantages, ref_logprobs, self.mini_batch_samples, self.dp_size,
                               self.spec.actor.loss_agg_mode, loss_weights,
                               balanced=self.spec.actor.micro_batch_tokens > 0)
        return mean_metrics(self._each("update_shard", [(shard, old_from_engine) for shard in shards],
                                       "the policy update"))

    def supervised_step(self, batch: TrainBatch, optimizer: torch.optim.Optimizer) -> float:
        """Not sharded: the format warm-up (for a random-init model) runs on one device."""
        raise NotImplementedError("the format warm-up is single-device only: set trainer.format_warmup_steps=0 or "
                                  "train on one device (trainer.n_gpus_per_node=1, trainer.nnodes=1)")

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, gathered from the shards to the driver (checkpoints, tests)."""
        states = self._each("full_state_dict", [()] * self.dp_size, "gathering the full weights")
        yield from states[0].items()

    def full_model(self) -> torch.nn.Module:
        """The policy as a plain HF model on the driver's CPU, with the current weights (for `save_pretrained`)."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        from vlmrl.models.tiny import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(self.spec.init_path or self.spec.actor.model_path))
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        model.load_state_dict(dict(self.named_tensors()), strict=True, assign=True)
        model.tie_weights()
        return model.eval()

    def save_adapter(self, folder: Path) -> None:
        """With LoRA: the PEFT adapter gathered from the shards into `folder`/adapter, as `Actor.save_adapter`."""
        if not self.spec.actor.lora.enabled:
            return
        from vlmrl.actor.lora import ADAPTER_DIR, write_adapter

        tensors, config = self._each("adapter_state", [()] * self.dp_size, "gathering the LoRA adapter")[0]
        write_adapter(Path(folder) / ADAPTER_DIR, tensors.items(), config)

    def state_dict(self) -> dict:
        """Optimizer (full: loadable on any number of ranks) and scheduler state, as `Actor.state_dict`."""
        return self._each("optimizer_state", [()] * self.dp_size, "reading optimizer state")[0]

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict()`'s result: rank 0 receives it and broadcasts each tensor to the others' shards."""
        others = {"optimizer": {}, "scheduler": state["scheduler"]}
        self._each("load_optimizer_state", [(state if rank == 0 else others,) for rank in range(self.dp_size)],
                   "loading optimizer state")

    # ---- rollout ----------------------------------------------------------------------------------------------------

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams, on_each: bool = False
                 ) -> list[RolloutResult] | list[list[RolloutResult]]:
        """Data-parallel generation: the requests cut into contiguous runs, one per engine; results request-major.
        A seeded request draws what it would draw on a single engine: each engine numbers its run from 0, so the
        run's seed starts at its first request's (`sample_seed`); with the same seed everywhere, the requests at the
        same place of two runs (the same prompt, or two trajectories of one group) would draw the same samples."""
        if self.spec.engine is None:
            raise RuntimeError("this DistributedActor was built without a rollout engine (WorkerSpec.engine)")
        layout = self.layout
        # on_each: every engine gets all the requests (the weight probe), one result list per engine
        runs = [requests] * len(layout.groups) if on_each else split_evenly(requests, len(layout.groups))
        starts = [0] * len(runs) if on_each else [sum(len(run) for run in runs[:k]) for k in range(len(runs))]
        # an spmd engine's TP ranks each get the group's requests (they compute together); the first rank's results
        callers = [group if layout.spmd else group[:1] for group in layout.groups]
        refs = [[self.workers[rank].generate.remote(run, replace(sampling, seed=sample_seed(sampling, start)))
                 for rank in ranks] for ranks, run, start in zip(callers, runs, starts)]
        got = self._get([ref for group in refs for ref in group], "generation")
        out: list = []
        for ranks in callers:
            parts, got = got[:len(ranks)], got[len(ranks):]
            for rank, part in zip(ranks[1:], parts[1:]):  # the TP ranks of one engine must agree, token for token
                if [r.response_ids for r in part] != [r.response_ids for r in parts[0]]:
                    raise RuntimeError(f"generation: the TP ranks of the engine on ranks {ranks} disagree (rank "
                                       f"{rank}'s tokens differ from rank {ranks[0]}'s): their scheduling or sampling "
                                       "is not deterministic")
            out += [parts[0]] if on_each else parts[0]
        return out if on_each else numbered_engines(out, [len(run) for run in runs], sampling.n)

    def sync_weights(self, backend: RolloutBackend) -> int:
        """Load the actor's current weights into every engine, gathered from the shards on the workers themselves:
        nothing goes through the driver. `backend` (the run's `ColocatedEngines`) only counts the load (the engines
        live in the workers). Returns the number of tensors each engine loaded.

        A group built without engines (its rollout engines are rollout workers of their own,
        `vlmrl.distributed.rollout_workers.RemoteEngines`) sends the weights from training rank 0 over the weight
        group where the workers take them that way (`RemoteEngines.sync_from_ranks`); otherwise (the object store)
        it gathers them to the driver and loads them through `backend.update_weights`."""
        if self.spec.engine is None:
            loaded = backend.sync_from_ranks(self)
            if loaded is not None:
                return loaded
            named = list(self.named_tensors())
            backend.update_weights(named)
            return len(named)
        loaded = max(self._each("sync_weights", [()] * self.dp_size, "weight sync"))
        backend.weights_loaded()
        return loaded

    # ---- the weight group's sender (`vlmrl.distributed.weight_transfer.WeightSource`): training rank 0

    def weight_group_address(self, port: int):
        return self.workers[0].weight_group_address.remote(port)

    def join_weight_group(self, group):
        return self.workers[0].join_weight_group.remote(group)

    def leave_weight_group(self):
        return self.workers[0].leave_weight_group.remote()

    def send_weights(self, recipe) -> tuple[Any, list[Any]]:
        return (self.workers[0].send_weights.remote(recipe),
                [worker.gather_weights.remote() for worker in self.workers[1:]])

    def load_engine_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load weights given here (the driver) into every engine: the generic path (see `sync_weights`)."""
        import ray

        shared = ray.put(named)  # stored once, read by every engine host
        self._get([self.workers[rank].load_engine_weights.remote(shared) for rank in self.hosts],
                  "loading weights into the engines")

    def close(self) -> None:
        """Stop the engines, leave the process group, end the workers and free the placement group."""
        if self.closed:
            return
        self.closed = True
        try:
            self._get([w.close.remote() for w in self.workers], "closing the workers", 60)
        except (RuntimeError, TimeoutError) as err:  # a worker that died (the error that ended the run said so)
            logger.warning("%s; the workers are ended with their engines", err)
        finally:
            self._release()

    def _release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement)
        # an spmd engine's CPU shared memory on this node, left by workers that died (or were killed just now)
        for path in Path("/dev/shm").glob(f"{getattr(self, 'shm_prefix', '-')}-g*"):
            path.unlink(missing_ok=True)

    def __enter__(self) -> DistributedActor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
