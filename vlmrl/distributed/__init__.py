"""Distributed training: Ray workers (one per device) holding an FSDP2-sharded actor and colocated rollout engines.

Ray is imported only when a `DistributedActor` is built; the single-process trainer never needs it.
"""

from vlmrl.distributed.actor import ShardedActor, UpdateShard
from vlmrl.distributed.group import ClusterConfig, DistributedActor
from vlmrl.distributed.vision import VisionAlwaysOn
from vlmrl.distributed.worker import EngineSpec, WorkerSpec

__all__ = [
    "ClusterConfig", "DistributedActor", "EngineSpec", "ShardedActor", "UpdateShard", "VisionAlwaysOn", "WorkerSpec",
]
