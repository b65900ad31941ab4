"""Distributed training: Ray workers (one per device) holding an FSDP2-sharded actor and colocated rollout engines.

Ray is imported only when a `DistributedActor` is built; the single-process trainer never needs it.
"""

from vlmrl.utils.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
