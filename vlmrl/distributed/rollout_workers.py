"""Rollout workers of their own: each rollout engine in a Ray actor (a process of its own, its engine at
rollout.tensor_parallel_size k across k devices or CPUs of one node), seen by the fit loop and validation as one
rollout backend (`RemoteEngines`). The asynchronous placement uses them with trainer.async_rollout.rollout_workers
> 0: the engines then generate in their processes while the trainer updates in its own, with no interpreter shared
between the two.

    trainer (driver):  update -> sync: every bucket broadcast over the weight group (or put into Ray's object store)
    worker k:          RolloutWorker(engine at TP k) : generate(its contiguous run of the requests) / receive weights

- **Placement.** Each worker is one Ray placement group of one bundle: k CPUs (and k GPUs on a GPU cluster) on one
  node, any node of the cluster that has room (Ray picks; the driver's node is not required). A cluster that cannot
  hold every worker's bundle within rollout.start_timeout_s is one named error, before any engine starts. The
  engine starts its own k TP processes (vLLM's mp executor, SGLang's tp_size) in the worker's bundle.
- **Generation** cuts the requests into one contiguous run per worker (results request-major). A seeded request
  draws what it draws on one engine (each run's seed starts at its first request's, `sample_seed`), so N workers give
  the single engine's samples, on whichever nodes they run.
- **Weight sync** (`vlmrl.distributed.weight_transfer`): the backends' bucketed sync plan (rollout.sync_bucket_mb
  in the engine's dtype and checkpoint names), sent through a collective group into every engine rank from the
  driver (dp = 1) or from training rank 0 (dp > 1, `sync_from_ranks`), or through Ray's object store
  (trainer.async_rollout.weight_transfer). Every sync carries a version; each
  worker reports the version it holds.
- **A worker that dies** (its process killed, its engine crashed: Ray reports the actor dead) is started again
  (trainer.async_rollout.worker_restarts times in a run), given the last synced weights, and its run of requests is
  generated again with the same seeds; once the restarts are used up, the call fails with EngineDeadError naming the
  worker. A death during a collective sync restarts the dead worker (and any whose engine the broken load left
  half-loaded), forms the group again and sends the whole sync again; between syncs, the object store path reloads
  the stored copy, while the collective path (which stores nothing) cuts the requests again over the workers that
  hold the current weights (each result names the engine that made it), leaves the restarted one out of the weight
  probe, and forms the group again at the next sync, which brings it back. A call that overruns
  rollout.timeout_s fails with EngineTimeoutError. Never a hang.
- **Adapters** (a LoRA policy synced as its adapter) travel as the folder's files through the object store, written
  by each worker into a folder of its own: the driver's disk need not be shared with the workers' nodes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vlmrl.distributed.engines import engine_dtype
from vlmrl.distributed.group import FORWARDED_ENV, ensure_ray
from vlmrl.distributed.weight_transfer import CollectiveSender, WeightSource, port_is_free, resolve_transfer
from vlmrl.distributed.rollout_actor import GpuHolder, RolloutWorker, RolloutWorkerSpec
from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.errors import EngineDeadError, EngineTimeoutError, RestartsUsedUp, RolloutError
from vlmrl.rollout.registry import backend_class
from vlmrl.rollout.requests import numbered_engines, sample_seed
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.sequences import split_evenly

logger = logging.getLogger(__name__)

CALL_MARGIN_S = 30.0
"""Added to rollout.timeout_s for a call to a worker: the engine's own deadline inside it fires first."""


class RemoteEngines(RolloutBackend):
    """`workers` rollout engines in Ray actors of their own, as one backend (see the module docstring). Starts Ray
    (a local cluster) when this process has not joined one. Close it to end the workers."""

    def __init__(self, spec: RolloutWorkerSpec, workers: int, restarts: int = 1, use_gpu: bool | None = None,
                 driver_trains: bool = False, source: WeightSource | None = None):
        """`driver_trains`: the trainer runs in this process on this node's GPU (dp = 1), which Ray does not know
        of: it is reserved first (`_reserve_driver_gpu`), so that no worker's bundle is given it. `source`: the
        training ranks (dp > 1) that send each sync over the weight group themselves (`sync_from_ranks`); None:
        this process sends."""
        if workers < 1:
            raise ValueError(f"RemoteEngines needs at least one worker, got {workers}")
        super().__init__(spec.engine.model_path, spec.engine.options)
        cls = backend_class(spec.engine.name)
        self.name = spec.engine.name  # artifacts and logs name the real engine
        self.accepts_partial_weights = cls.accepts_partial_weights
        self.spec = spec
        self.tp = spec.tp
        self.restarts_left = restarts
        self.restarts = 0
        """Workers started again after dying (over the run)."""
        self.use_gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
        self.call_timeout_s = self.rollout.timeout_s + CALL_MARGIN_S
        self.closed = False
        self.close_after: list = []
        """More to close with these workers (at dp > 1, the training workers they serve: the run closes its
        backend)."""
        self.version = 0
        """Weight syncs sent so far: the version every worker holds after the last."""
        self._last_sync: tuple[list, list[str]] | None = None  # object store: the last weights loaded, for a restart
        self._last_adapter: dict[str, bytes] | None = None
        self.sender: CollectiveSender | None = None
        self._died: set[int] = set()  # workers whose actor Ray reported dead, until restarted
        self.workers: list = [None] * workers
        self.groups: list = [None] * workers
        self.infos: list[dict[str, Any]] = [{} for _ in range(workers)]
        # what the engine class receives over decides the transfer, and a group port that is taken stops the run,
        # both before any worker starts
        self.transfer = self._resolve_transfer([tuple(cls.weight_group_backends)])
        if self.transfer == "collective" and spec.group_port:
            try:
                port_is_free(self._driver_address(), spec.group_port)
            except RuntimeError as err:
                raise RolloutError(f"{self.name}: trainer.async_rollout.weight_transfer={spec.weight_transfer}: "
                                   f"{err}. Use weight_transfer=object_store, or free the port "
                                   "(weight_group_port)") from None
        ensure_ray(workers * self.tp)
        self.driver_gpu = None
        try:
            if driver_trains and self.use_gpu:
                self._reserve_driver_gpu()
            self._reserve(range(workers))
            for index in range(workers):  # started at once, waited for together
                self.workers[index] = self._spawn(index)
            self._wait_started(range(workers))
            self._serves_adapters = bool(self.infos[0]["serves_adapters"])
            # the dtype the workers' engines resolved where they run (`auto` follows THEIR devices, not the driver's)
            self.dtype = engine_dtype([info["dtype"] for info in self.infos], self.dtype, self.name)
            if self.transfer == "collective":  # formed now: a group the engines refuse stops the run before training
                self.sender = CollectiveSender(self.group_backend, self._driver_address(), spec.group_port,
                                               self.rollout.timeout_s, self._get, source=source)
                self._form_group()
        except BaseException:
            self.close()
            raise
        logger.info("rollout workers: %d %s engine(s) at tensor parallel %d on nodes %s; weights through %s",
                    workers, self.name, self.tp, sorted({info.get("node", "?")[:8] for info in self.infos}),
                    "a collective group" if self.transfer == "collective" else "Ray's object store")

    # ---- the workers

    @property
    def group_backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"

    def _resolve_transfer(self, engines_take: list[tuple[str, ...]]) -> str:
        try:
            return resolve_transfer(self.spec.weight_transfer, self.group_backend, engines_take, self.name)
        except ValueError as err:
            raise RolloutError(str(err)) from None

    def _driver_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def _bundle(self) -> dict[str, float]:
        return {"CPU": self.tp, **({"GPU": self.tp} if self.use_gpu else {})}

    def _reserve(self, indices: Iterable[int]) -> None:
        """A placement group of one bundle (k CPUs, k GPUs on a GPU cluster: one node) for each worker, any node."""
        from ray.util.placement_group import placement_group

        for index in indices:
            self.groups[index] = placement_group([self._bundle()], strategy="STRICT_PACK",
                                                 name=f"vlmrl-rollout-worker-{index}-{os.getpid()}-{id(self)}")
        self._await_groups(indices)

    def _await_groups(self, indices: Iterable[int]) -> None:
        """The workers' placement groups placed within rollout.start_timeout_s (again, after a node is lost: Ray
        places a group again where there is room), else one error naming what the cluster lacks."""
        import ray

        ready = [self.groups[i].ready() for i in indices]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=self.rollout.start_timeout_s)
        if len(done) < len(ready):
            nodes = [{k: v for k, v in node["Resources"].items() if k in ("CPU", "GPU")}
                     for node in ray.nodes() if node.get("Alive")]
            raise RolloutError(f"{self.name}: the Ray cluster cannot hold {len(ready) - len(done)} of "
                               f"{len(ready)} rollout workers within {self.rollout.start_timeout_s:.0f} s: each "
                               f"needs {self._bundle()} on one node (rollout.tensor_parallel_size={self.tp}); the "
                               f"cluster's live nodes have {nodes}. Add nodes, or lower "
                               "trainer.async_rollout.rollout_workers or rollout.tensor_parallel_size")

    def _reserve_driver_gpu(self) -> None:
        """Hold one GPU of the driver's node in Ray for the trainer that runs in this process (Ray hands a free node's
        GPUs out lowest id first: the trainer's cuda:0); on a node with one GPU the workers share it instead, as a
        one-GPU machine must, and the log says so."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == here), 0)
        if gpus < 2:
            logger.warning("rollout workers: the driver's node has %d GPU: the trainer and the rollout workers placed "
                           "there share it", gpus)
            return
        holder = ray.remote(num_gpus=1, num_cpus=0)(GpuHolder).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote()
        ids = self._get(holder.gpu_ids.remote(), 0, "reserving the trainer's GPU", self.rollout.start_timeout_s)
        self.driver_gpu = holder
        if ids != ["0"] and ids != [0]:
            logger.warning("rollout workers: Ray reserved GPU %s of the driver's node for the trainer, which runs on "
                           "cuda:0: a worker may be given the trainer's device", ids)

    def _spawn(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV)}
        where = PlacementGroupSchedulingStrategy(self.groups[index], placement_group_bundle_index=0,
                                                 placement_group_capture_child_tasks=True)
        # the actor takes the whole bundle: Ray sets CUDA_VISIBLE_DEVICES to its k GPUs for the engine's TP ranks
        remote = ray.remote(RolloutWorker).options(num_cpus=self.tp, num_gpus=self.tp if self.use_gpu else 0,
                                                   max_restarts=0, max_concurrency=1, scheduling_strategy=where,
                                                   runtime_env={"env_vars": env})
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
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except RayTaskError as err:  # the worker's own error, as it was raised there (its type and one-line message)
            if isinstance(err.cause, Exception):
                raise err.cause from None
            raise
        except GetTimeoutError:
            raise EngineTimeoutError(f"{self.name}: {what}: rollout worker {index} gave no answer within "
                                     f"{timeout:.0f} s") from None
        except RayActorError as err:
            self._died.add(index)
            raise EngineDeadError(f"{self.name}: {what}: rollout worker {index} (pid {self.infos[index].get('pid')}) "
                                  f"died: {type(err).__name__}") from err

    def _form_group(self) -> None:
        try:
            self.sender.form(self.workers, [self.tp] * len(self.workers))
        except (RuntimeError, EngineTimeoutError) as err:
            raise RolloutError(f"{self.name}: trainer.async_rollout.weight_transfer={self.transfer}: {err}. Use "
                               "weight_transfer=object_store, or free the port (weight_group_port)") from err

    def _restart(self, index: int, error: EngineDeadError, load: bool = True) -> None:
        """Start worker `index` again, in its placement group (Ray places a group again on a node that has room
        when its node is gone), and give it the last synced weights (`load`), or raise `error` when no restart is
        left."""
        if self.restarts_left <= 0:
            raise RestartsUsedUp(f"{error} (trainer.async_rollout.worker_restarts used up: the run stops)") from error
        self.restarts_left -= 1
        self.restarts += 1
        logger.warning("%s; starting it again (%d restart(s) left)", error, self.restarts_left)
        self._respawn(index)
        if load:
            self._reload(index)

    def _respawn(self, index: int) -> None:
        import ray

        _end_leftovers(self.infos[index])
        if self.workers[index] is not None:
            ray.kill(self.workers[index])
        self._await_groups([index])
        self.workers[index] = self._spawn(index)
        self._wait_started([index])
        self._died.discard(index)

    def _reload(self, index: int) -> None:
        """The last synced weights into a restarted worker: the stored copy (object store, adapter files); with the
        collective group, nothing is stored: the worker waits for the next sync (`current` leaves it out)."""
        if self._last_adapter is not None:
            self.infos[index]["version"] = self._get(
                self.workers[index].update_adapter.remote(self._last_adapter, self.version), index,
                "loading the adapter")
        elif self._last_sync is not None:
            buckets, names = self._last_sync
            self.infos[index]["version"] = self._get(
                self.workers[index].update_weights.remote(buckets, names, self.version), index, "loading the weights")
        elif self.transfer == "collective" and self.version > 0:
            logger.warning("%s: rollout worker %d was restarted between weight syncs: it holds the start weights "
                           "and generates again after the next sync (the collective group stores no copy)",
                           self.name, index)

    def current(self) -> list[int]:
        """The workers whose engine holds the last sync's weights."""
        return [i for i, info in enumerate(self.infos) if info.get("version") == self.version]

    def _on_each(self, calls: list[tuple[int, Any]], what: str, current_only: bool = False) -> list[Any]:
        """Run `call(worker)` for each (index, call) at once; a worker that died is restarted and its call made again
        on it (its own question: a death is always blamed on, and restarts, the worker that died). Results in the
        calls' order. `current_only`: a worker that the restart left without the last sync's weights (the collective
        group stores no copy to reload) is asked nothing more: its result is None."""
        refs = {index: call(self.workers[index]) for index, call in calls}
        out: dict[int, Any] = {}
        for index, call in calls:
            while index not in out:
                try:
                    out[index] = self._get(refs[index], index, what)
                except EngineDeadError as err:
                    if index not in self._died:
                        raise
                    self._restart(index, err)
                    if current_only and index not in self.current():
                        out[index] = None
                    else:
                        refs[index] = call(self.workers[index])
        return [out[index] for index, _ in calls]

    # ---- the backend

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """The requests cut into one contiguous run per worker that holds the last sync's weights. A worker that dies
        and is started again without them (the collective group stores no copy) drops out: the requests are cut
        again over the workers that hold them and generated again with the same seeds (a seeded request draws the
        same samples on any engine), so each result names the engine that made it."""
        while True:
            workers = self.current()
            if not workers:
                raise EngineDeadError(f"{self.name}: no rollout worker holds the last synced weights (version "
                                      f"{self.version}): every one was restarted since and waits for the next sync "
                                      "(trainer.async_rollout.weight_transfer=collective stores no copy to reload; "
                                      "object_store does)")
            runs = split_evenly(list(requests), len(workers))
            starts = [sum(len(run) for run in runs[:k]) for k in range(len(runs))]
            calls = [(index, (lambda w, run=run, s=replace(sampling, seed=sample_seed(sampling, start)):
                              w.generate.remote(run, s)))
                     for index, run, start in zip(workers, runs, starts) if run]
            parts = self._on_each(calls, "generation", current_only=True)
            if all(part is not None for part in parts):
                break
            logger.warning("%s: rollout worker(s) %s restarted without the last synced weights: their requests go to "
                           "workers %s", self.name, [i for (i, _), part in zip(calls, parts) if part is None],
                           self.current())
        results = [result for part in parts for result in part]
        return numbered_engines(results, [len(run) for run in runs], sampling.n,
                                engines=workers if len(self.workers) > 1 else None)

    def generate_on_each(self, requests: Sequence[RolloutRequest], sampling: SamplingParams
                         ) -> list[list[RolloutResult]]:
        """The same requests on every worker (the weight probe's question to each engine after a sync); a worker
        that holds no current weights (restarted between collective syncs: it generates nothing until the next)
        answers []."""
        self.check_requests(requests, sampling)
        current = self.current()
        answers = self._on_each([(i, lambda w: w.generate.remote(list(requests), sampling)) for i in current],
                                "generation on each worker", current_only=True)
        by_worker = dict(zip(current, answers))
        return [by_worker.get(i) or [] for i in range(len(self.workers))]

    def weights_checksums(self) -> list[str]:
        """Each worker's `weights_checksum`: equal on workers that hold the same weights (a worker restarted between
        collective syncs gives its start weights')."""
        return self._on_each([(i, lambda w: w.weights_checksum.remote()) for i in range(len(self.workers))],
                             "checksum of the weights")

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        self.version += 1
        if self.transfer == "collective" and self.sender.source is None:
            again = isinstance(named_tensors, (list, tuple))
            self._send_collective(lambda: self.sender.send(self.sync_plan(named_tensors, names).buckets,
                                                           self.version), again)
        else:  # weights this process holds, where training rank 0 sends over the group: through the object store
            self._send_stored(named_tensors, names)
        self._check_versions()

    def send_from(self, source: WeightSource | None) -> None:
        """Who sends the collective syncs from now on: the training ranks `source` (`sync_from_ranks`), or this
        process (None, `update_weights`). The group forms again with that sender."""
        if self.sender is None:
            raise RolloutError(f"{self.name}: the weights reach the rollout workers through Ray's object store: "
                               "there is no weight group to send over")
        if self.sender.source is not source:
            self.sender.close()
            self.sender.source = source
            self._form_group()

    def sync_from_ranks(self, source: WeightSource) -> int | None:
        """The sync sent by the training ranks over the weight group (the group formed with them as its sender:
        `source`), the whole weights passing through no other process; None with the object store, or a group
        whose sender is this process."""
        if self.sender is None or self.sender.source is not source:
            return None
        self.version += 1
        recipe = self.sync_recipe()
        loaded: list[int] = []

        def send() -> int:
            sent, tensors = self.sender.send_from_source(recipe, self.version)
            loaded.append(tensors)
            return sent

        self._send_collective(send, again=True)  # the ranks gather again for a resend
        self._check_versions()
        self.weights_dropped = False
        self.weights_loaded()
        return loaded[-1]

    def _check_versions(self) -> None:
        behind = [i for i, info in enumerate(self.infos) if info.get("version") != self.version]
        if behind:  # never a run on mixed weights
            raise RolloutError(f"{self.name}: weight sync {self.version} did not reach rollout workers {behind}")

    def _send_stored(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None) -> None:
        import ray

        buckets, order = [], []
        for bucket in self.sync_plan(named_tensors, names).buckets:  # cast and cut as the trainer's weights are read
            order.extend(bucket)
            buckets.append(ray.put(bucket))  # once: every worker reads the same objects
        self._last_sync, self._last_adapter = (buckets, order), None
        versions = self._on_each([(i, lambda w: w.update_weights.remote(buckets, order, self.version))
                                  for i in range(len(self.workers))], "weight sync")
        for info, version in zip(self.infos, versions):
            info["version"] = version

    def _send_collective(self, send: Callable[[], int], again: bool) -> None:
        """A sync over the group (`send()`: its bytes), the group formed again first when a worker was started
        again since it formed (its new engine is not in the old group). A worker that dies during the sync is
        restarted (one restart), every other worker started again too (the broken load left its engine
        half-loaded; not counted), the group formed again and the whole sync sent again where it can be (`again`:
        the weights can be read a second time; a stream read once makes it an error)."""
        self._last_sync, self._last_adapter = None, None
        self._died.clear()
        members = [m.worker for m in self.sender.members]
        if len(members) != len(self.workers) or any(a is not b for a, b in zip(members, self.workers)):
            self._form_group()
        for attempt in range(2):
            try:
                self.sent_bytes = send()
                break
            except (RuntimeError, RolloutError) as err:
                dead = sorted(self._died)
                if attempt or not dead or not again:
                    raise RolloutError(f"{self.name}: weight sync {self.version} over the collective group failed: "
                                       f"{err}") from err
                self.sender.close()
                self._restart(dead[0], err if isinstance(err, EngineDeadError) else EngineDeadError(str(err)),
                              load=False)
                for index in range(len(self.workers)):
                    if index != dead[0]:
                        self._respawn(index)
                self._form_group()
        for info in self.infos:
            info["version"] = self.version

    def serves_adapters(self) -> bool:
        return self._serves_adapters

    def _update_adapter(self, folder: str) -> None:
        self.version += 1
        files = {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}
        self._last_adapter, self._last_sync = files, None
        versions = self._on_each([(i, lambda w: w.update_adapter.remote(files, self.version))
                                  for i in range(len(self.workers))], "adapter update")
        for info, version in zip(self.infos, versions):
            info["version"] = version

    def close(self) -> None:
        """End every worker, the engine processes it started and its placement group. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.sender is not None:
            self.sender.close()
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
        if self.driver_gpu is not None:
            ray.kill(self.driver_gpu)
        for group in self.groups:
            if group is not None:
                try:
                    remove_placement_group(group)
                except Exception as err:  # noqa: BLE001 - the cluster may be gone already
                    logger.warning("removing a rollout worker's placement group: %s", err)
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
