"""What runs in a rollout worker's own process (a Ray actor; `vlmrl.distributed.rollout_workers.RemoteEngines`
drives them from the trainer's): its engine, the weight version it holds, the three ways weights reach it (buckets
from the object store, broadcasts over the weight group, an adapter's files) and the LoRA adapters it writes into a
folder of its own. Plus the placeholder that holds the trainer's GPU in Ray's accounting."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.distributed.worker import EngineSpec
from vlmrl.rollout.weight_group import BucketMeta, WeightGroup
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RolloutWorkerSpec:
    """What every rollout worker starts."""

    engine: EngineSpec
    """Its engine: the backend's name, the weights it starts from and the options the run built for it (not
    colocated: a worker's engine has its process, and on a GPU node its devices, to itself)."""
    torch_threads: int = 0
    """torch.set_num_threads in the worker; 0 = torch's default."""
    weight_transfer: str = "auto"
    """trainer.async_rollout.weight_transfer: auto | collective | object_store (`vlmrl.distributed.weight_transfer`)."""
    group_port: int = 0
    """trainer.async_rollout.weight_group_port: the port the driver listens on for the weight group; 0 = a free one."""

    @property
    def tp(self) -> int:
        return self.engine.options.rollout.tensor_parallel_size


class RolloutWorker:
    """One engine in a Ray actor. Its methods are called by `RemoteEngines` through Ray."""

    def __init__(self, spec: RolloutWorkerSpec, index: int):
        from vlmrl.rollout.registry import get_backend

        if spec.torch_threads > 0:
            torch.set_num_threads(spec.torch_threads)
        self.index = index
        self.version = 0
        """The weight sync the engine holds (0: the weights it started from)."""
        engine = spec.engine
        logger.info("rollout worker %d: starting rollout backend %s on %s", index, engine.name, engine.model_path)
        self.backend = get_backend(engine.name, engine.model_path, engine.options)
        self.adapters = Path(tempfile.mkdtemp(prefix=f"vlmrl-rollout-worker-{index}-"))

    def info(self) -> dict[str, Any]:
        """The worker's process and node, its engine's processes (to end if the worker dies), its backend's name,
        dtype and what it receives weights over, and the weight version it holds."""
        import psutil
        import ray

        engines = [(pid, psutil.Process(pid).create_time()) for pid in self.backend.engine_pids
                   if psutil.pid_exists(pid)]
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "engines": engines,
                "name": self.backend.name, "dtype": self.backend.dtype, "version": self.version,
                "serves_adapters": self.backend.serves_adapters(),
                "group_backends": tuple(self.backend.weight_group_backends)}

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        return self.backend.generate(requests, sampling)

    def update_weights(self, buckets: list, names: list[str], version: int) -> int:
        """Stream the buckets (object refs of {checkpoint name: tensor}, in `names`' order) into the engine, one at a
        time; the engine then holds sync `version`."""
        import ray

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for ref in buckets:
                yield from ray.get(ref).items()

        self.backend.update_weights(stream(), names)
        self.version = version
        return version

    def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self.backend.join_weight_group(group, rank_offset)

    def begin_receive(self) -> None:
        self.backend.begin_receive()

    def receive_bucket(self, meta: BucketMeta) -> int:
        return self.backend.receive_bucket(meta)

    def end_receive(self, version: int) -> int:
        self.backend.end_receive()
        self.version = version
        return version

    def weights_checksum(self) -> str:
        return self.backend.weights_checksum()

    def update_adapter(self, files: dict[str, bytes], version: int) -> int:
        """Write the adapter's files into this worker's own folder and generate under it from now on."""
        folder = self.adapters / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        self.backend.update_adapter(str(folder))
        self.version = version
        return version

    def close(self) -> None:
        import shutil

        try:
            self.backend.leave_weight_group()
        finally:
            self.backend.close()
            shutil.rmtree(self.adapters, ignore_errors=True)


class GpuHolder:
    """Holds a GPU in Ray's accounting for the trainer running in the driver's process."""

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()
