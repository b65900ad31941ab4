"""Cluster configuration: how many training devices, on how many nodes, and where the rollout engines run.

Its keys are set in the run config's `trainer` section (`trainer.n_gpus_per_node`, `trainer.nnodes`,
`trainer.engine_placement`): `vlmrl.trainer.config.TrainerConfig` inherits this class. More than one device in all
runs Ray workers with FSDP2 (`vlmrl.distributed.DistributedActor`). The Ray cluster to join is $RAY_ADDRESS (a
local one is started when it is unset).
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_PLACEMENTS = ("worker", "node")


@dataclass
class ClusterConfig:
    n_gpus_per_node: int = 1
    """Training devices per node; more than one device in all runs Ray workers with FSDP2 (vlmrl.distributed)."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    engine_placement: str = "worker"
    """With several devices, where the colocated rollout engines run: `worker` = one per training worker, `node` =
    one per node (on its first worker; the node's requests go to it)."""

    @property
    def world_size(self) -> int:
        return self.n_gpus_per_node * self.nnodes

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.n_gpus_per_node < 1 or self.nnodes < 1:
            out.append("trainer.n_gpus_per_node and trainer.nnodes must be >= 1")
        if self.engine_placement not in ENGINE_PLACEMENTS:
            out.append(f"trainer.engine_placement={self.engine_placement!r} is not one of {list(ENGINE_PLACEMENTS)}")
        return out
