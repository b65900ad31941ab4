"""Distributed training: Ray workers (one per device) holding an FSDP2-sharded actor (`actor`, `worker`) and colocated
rollout engines, driven as one `PolicyActor` (`group.DistributedActor`); rollout workers of their own for the
asynchronous placement (`rollout_workers`).

Ray is imported only when a `DistributedActor` is built; the single-process trainer never needs it.
"""
