"""Distributed training: Ray workers (one per device) holding an FSDP2-sharded actor and colocated rollout engines.

Ray is imported only when a `DistributedActor` is built; the single-process trainer never needs it.
"""

from vlmrl.utils.lazy import lazy_exports

# Imported on first use: importing the package loads neither torch nor Ray.
_LAZY = {
    "ShardedActor": "actor",
    "UpdateShard": "actor",
    "DistributedActor": "group",
    "VisionAlwaysOn": "vision",
    "EngineSpec": "worker",
    "WorkerSpec": "worker",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
