"""Rollout workers of their own: each rollout engine in a Ray actor (a process of its own; on a GPU node, a device
of its own), seen by the fit loop and validation as one rollout backend (`RemoteEngines`). The asynchronous
placement uses them with trainer.async_rollout.rollout_workers > 0: the engines then generate in their processes
while the trainer updates in its own, with no interpreter shared between the two.

    trainer (driver):  update -> sync: the buckets into Ray's object store once -> every worker loads them
    worker k:          RolloutWorker(engine) : generate(its contiguous run of the requests) / update_weights(buckets)

- **Generation** cuts the requests into one contiguous run per worker (results request-major). A seeded request
  draws what it draws on one engine (each run's seed starts at its first request's, `sample_seed`), so N workers give
  the single engine's samples.
- **Weight sync** is the backends' own bucketed path: the driver cuts the weights into rollout.sync_bucket_mb
  buckets in the engine's dtype and checkpoint names (`sync_plan`), puts each bucket into Ray's object store once,
  and every worker streams them into its engine a bucket at a time. The object store holds one copy of the weights
  in the engine's dtype until the next sync: a worker that is restarted loads them from there.
- **A worker that dies** (its process killed, its engine crashed: Ray reports the actor dead) is started again
  (trainer.async_rollout.worker_restarts times in a run), given the last synced weights, and its run of requests is
  generated again with the same seeds; once the restarts are used up, the call fails with EngineDeadError naming the
  worker. A call that overruns rollout.timeout_s fails with EngineTimeoutError. Never a hang.
- **Devices.** The workers run on the driver's node. On a node with GPUs the trainer's come first (GPU 0 at dp = 1, in the driver; 0..dp-1 at dp > 1) and
  worker k gets the next, GPU dp + k (`CUDA_VISIBLE_DEVICES`, set for it; Ray does not assign it), modulo the node's
  GPUs: on one GPU the worker shares it with the trainer. On CPU each worker reserves one Ray CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlmrl.distributed.engines import engine_dtype
from vlmrl.distributed.group import FORWARDED_ENV, ensure_ray
from vlmrl.distributed.worker import EngineSpec
from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.errors import EngineDeadError, EngineTimeoutError, RestartsUsedUp
from vlmrl.rollout.registry import backend_class
from vlmrl.rollout.requests import numbered_engines, sample_seed
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.sequences import split_evenly

logger = logging.getLogger(__name__)

CALL_MARGIN_S = 30.0
"""Added to rollout.timeout_s for a call to a worker: the engine's own deadline inside it fires first."""


@dataclass
class RolloutWorkerSpec:
    """What every rollout worker starts."""

    engine: EngineSpec
    """Its engine: the backend's name, the weights it starts from and the options the run built for it (not
    colocated: a worker's engine has its process, and on a GPU node its device, to itself)."""
    torch_threads: int = 0
    """torch.set_num_threads in the worker; 0 = torch's default."""


class RolloutWorker:
    """One engine in a Ray actor. Its methods are called by `RemoteEngines` through Ray."""

    def __init__(self, spec: RolloutWorkerSpec, index: int):
        from vlmrl.rollout.registry import get_backend

        if spec.torch_threads > 0:
            torch.set_num_threads(spec.torch_threads)
        self.index = index
        engine = spec.engine
        logger.info("rollout worker %d: starting rollout backend %s on %s", index, engine.name, engine.model_path)
        self.backend = get_backend(engine.name, engine.model_path, engine.options)

    def info(self) -> dict[str, Any]:
        """The worker's process, its engine's processes (to end if the worker dies) and its backend's name."""
        import psutil

        engines = [(pid, psutil.Process(pid).create_time()) for pid in self.backend.engine_pids
                   if psutil.pid_exists(pid)]
        return {"pid": os.getpid(), "engines": engines, "name": self.backend.name, "dtype": self.backend.dtype,
                "serves_adapters": self.backend.serves_adapters()}

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        return self.backend.generate(requests, sampling)

    def update_weights(self, buckets: list, names: list[str]) -> None:
        """Stream the buckets (object refs of {checkpoint name: tensor}, in `names`' order) into the engine, one at a
        time."""
        import ray

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for ref in buckets:
                yield from ray.get(ref).items()

        self.backend.update_weights(stream(), names)

    def update_adapter(self, folder: str) -> None:
        self.backend.update_adapter(folder)

    def close(self) -> None:
        self.backend.close()


class RemoteEngines(RolloutBackend):
    """`workers` rollout engines in Ray actors of their own, as one backend (see the module docstring). Starts Ray
    (a local cluster) when this process has not joined one. Close it to end the workers."""

    def __init__(self, spec: RolloutWorkerSpec, workers: int, restarts: int = 1, use_gpu: bool | None = None,
                 first_device: int = 1):
        if workers < 1:
            raise ValueError(f"RemoteEngines needs at least one worker, got {workers}")
        super().__init__(spec.engine.model_path, spec.engine.options)
        cls = backend_class(spec.engine.name)
        self.name = spec.engine.name  # artifacts and logs name the real engine
        self.accepts_partial_weights = cls.accepts_partial_weights
        self.spec = spec
        self.restarts_left = restarts
        self.restarts = 0
        """Workers started again after dying (over the run)."""
        self.use_gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
        self.first_device = first_device
        """GPU of worker 0 (the trainer's devices before it: 1 at dp = 1, dp at dp > 1)."""
        self.call_timeout_s = self.rollout.timeout_s + CALL_MARGIN_S
        self.closed = False
        self.close_after: list = []
        """More to close with these workers (at dp > 1, the training workers they serve: the run closes its
        backend)."""
        self._last_sync: tuple[list, list[str]] | None = None  # the last weights loaded (object refs), for a restart
        self._last_adapter: str | None = None
        self.workers: list = [None] * workers
        self.infos: list[dict[str, Any]] = [{} for _ in range(workers)]
        ensure_ray(workers)
        try:
            for index in range(workers):  # started at once, waited for together
                self.workers[index] = self._spawn(index)
            self._wait_started(range(workers))
        except BaseException:
            self.close()
            raise
        self._serves_adapters = bool(self.infos[0]["serves_adapters"])
        # the dtype the workers' engines resolved where they run (`auto` follows THEIR devices, not the driver's)
        self.dtype = engine_dtype([info["dtype"] for info in self.infos], self.dtype, self.name)

    # ---- the workers

    def _spawn(self, index: int):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        env = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV)}
        if self.use_gpu:  # the trainer's GPUs come first; on a node with too few GPUs some share one
            device = (self.first_device + index) % max(1, torch.cuda.device_count())
            env.update({"CUDA_VISIBLE_DEVICES": str(device), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
        # on the driver's node: the GPUs counted above are its own, and an adapter folder it writes is readable
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        remote = ray.remote(RolloutWorker).options(num_cpus=1, num_gpus=0, max_restarts=0, max_concurrency=1,
                                                   scheduling_strategy=here, runtime_env={"env_vars": env})
        return remote.remote(self.spec, index)

    def _wait_started(self, indices: Iterable[int]) -> None:
        indices = list(indices)
        timeout = self.rollout.start_timeout_s + CALL_MARGIN_S
        infos = self._get([self.workers[i].info.remote() for i in indices], indices[0], "starting the engine",
                          timeout)
        for i, info in zip(indices, infos):
            self.infos[i] = info
        self.engine_pids = []  # the engines run in the workers' processes, which close() ends
        self.worker_pids = [info.get("pid") for info in self.infos]
        logger.info("rollout workers: %s engines in processes %s", self.name, self.worker_pids)

    def _get(self, refs, index: int, what: str, timeout_s: float | None = None):
        """ray.get with a deadline; a dead worker becomes EngineDeadError, an overrun EngineTimeoutError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise EngineTimeoutError(f"{self.name}: {what}: rollout worker {index} gave no answer within "
                                     f"{timeout:.0f} s") from None
        except RayActorError as err:
            raise EngineDeadError(f"{self.name}: {what}: rollout worker {index} (pid {self.infos[index].get('pid')}) "
                                  f"died: {type(err).__name__}") from err

    def _restart(self, index: int, error: EngineDeadError) -> None:
        """Start worker `index` again and give it the last synced weights, or raise `error` when no restart is left."""
        if self.restarts_left <= 0:
            raise RestartsUsedUp(f"{error} (trainer.async_rollout.worker_restarts used up: the run stops)") from error
        self.restarts_left -= 1
        self.restarts += 1
        logger.warning("%s; starting it again (%d restart(s) left)", error, self.restarts_left)
        _end_leftovers(self.infos[index])
        self.workers[index] = self._spawn(index)
        self._wait_started([index])
        if self._last_adapter is not None:
            self._get(self.workers[index].update_adapter.remote(self._last_adapter), index, "loading the adapter")
        elif self._last_sync is not None:
            buckets, names = self._last_sync
            self._get(self.workers[index].update_weights.remote(buckets, names), index, "loading the weights")

    def _on_each(self, calls: list[tuple[int, Any]], what: str) -> list[Any]:
        """Run `call(worker)` for each (index, call) at once; a worker that died is restarted and its call made again.
        Results in the calls' order."""
        import ray

        refs = {index: call(self.workers[index]) for index, call in calls}
        out: dict[int, Any] = {}
        for index, call in calls:
            while index not in out:
                try:
                    out[index] = self._get(refs[index], index, what)
                except EngineDeadError as err:
                    if not isinstance(err.__cause__, ray.exceptions.RayActorError):
                        raise
                    self._restart(index, err)
                    refs[index] = call(self.workers[index])
        return [out[index] for index, _ in calls]

    # ---- the backend

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        runs = split_evenly(list(requests), len(self.workers))
        starts = [sum(len(run) for run in runs[:k]) for k in range(len(runs))]
        calls = [(index, (lambda w, run=run, s=replace(sampling, seed=sample_seed(sampling, start)):
                          w.generate.remote(run, s)))
                 for index, (run, start) in enumerate(zip(runs, starts)) if run]
        results = [result for part in self._on_each(calls, "generation") for result in part]
        return numbered_engines(results, [len(run) for run in runs], sampling.n)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        import ray

        buckets, order = [], []
        for bucket in self.sync_plan(named_tensors, names).buckets:  # cast and cut as the trainer's weights are read
            order.extend(bucket)
            buckets.append(ray.put(bucket))  # once: every worker reads the same objects
        self._last_sync, self._last_adapter = (buckets, order), None
        self._on_each([(i, lambda w: w.update_weights.remote(buckets, order)) for i in range(len(self.workers))],
                      "weight sync")

    def serves_adapters(self) -> bool:
        return self._serves_adapters

    def _update_adapter(self, folder: str) -> None:
        self._last_adapter = folder
        self._on_each([(i, lambda w: w.update_adapter.remote(folder)) for i in range(len(self.workers))],
                      "adapter update")

    def close(self) -> None:
        """End every worker and the engine processes it started. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        import ray

        alive = [w for w in self.workers if w is not None]
        try:
            ray.get([w.close.remote() for w in alive], timeout=60)
        except Exception as err:  # noqa: BLE001 - a dead worker has nothing left to close
            logger.warning("closing the rollout workers: %s", err)
        for worker, info in zip(self.workers, self.infos):
            if worker is not None:
                ray.kill(worker)
            _end_leftovers(info)
        _wait_gone([info.get("pid") for info in self.infos])
        self._last_sync = None
        for close in self.close_after:
            close()


def _end_leftovers(info: dict[str, Any]) -> None:
    """End the engine processes a dead worker left behind (an engine server it launched): only those it named, and
    only while their pid still names the same process (its start time)."""
    import psutil

    for pid, started in info.get("engines", []):
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.kill()
        except psutil.Error:
            pass


def _wait_gone(pids: list[int | None], timeout_s: float = 15.0) -> None:
    """Wait for the workers' processes on this node to end (ray.kill returns before they have)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            process = psutil.Process(pid) if pid else None
            if process is not None and "RolloutWorker" in " ".join(process.cmdline()):
                procs.append(process)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    if alive:
        logger.warning("rollout worker processes %s still run %.0f s after they were ended", [p.pid for p in alive],
                       timeout_s)
