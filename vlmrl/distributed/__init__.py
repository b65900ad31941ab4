"""Distributed training: Ray workers (one per device) holding an FSDP2-sharded actor and colocated rollout engines.

Ray is imported only when a `DistributedActor` is built; the single-process trainer never needs it.
"""

from importlib import import_module

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "ShardedActor": "actor",
    "UpdateShard": "actor",
    "ClusterConfig": "config",
    "DistributedActor": "group",
    "VisionAlwaysOn": "vision",
    "EngineSpec": "worker",
    "WorkerSpec": "worker",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"vlmrl.distributed.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlmrl.distributed' has no attribute {name!r}")


__all__ = sorted(_LAZY)
