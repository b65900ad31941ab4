"""A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head node and nodes of their own, each
a raylet with its own logical CPUs), for the tests of rollout workers placed off the driver's node. The head holds
no CPU, so every worker's placement group lands on another node, as on a cluster whose trainer node is full."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest
import torch


@contextlib.contextmanager
def simulated_cluster(*node_cpus: int):
    """A head node (0 CPUs: the driver's) and one node per entry of `node_cpus`; yields (cluster, [node handles]).
    Ray's files go to a short temp folder of its own (Unix socket paths are limited to ~107 characters)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vlmrl-rc-")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir  # where cluster_utils writes the head's address
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=cpus) for cpus in node_cpus]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=True)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """The driver's head node and two rollout nodes of 2 CPUs each (logical: the machine has two cores)."""
    with simulated_cluster(2, 2) as started:
        yield started


def remote_engines(name: str, tp: int, workers: int = 1, start_timeout_s: float = 300, **spec):
    """`workers` rollout workers of `name` at TP `tp` on the embedded tiny model (float32, buckets of 0.25 MiB:
    several per sync)."""
    from vlmrl.distributed.rollout_actor import RolloutWorkerSpec
    from vlmrl.distributed.rollout_workers import RemoteEngines
    from vlmrl.distributed.worker import EngineSpec
    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.base import BackendOptions

    serving = {"tensor_parallel_size": tp} if name != "hf" else {}  # hf runs on one device
    options = BackendOptions.from_kwargs(name, {"dtype": "float32", "max_model_len": 1024, "timeout_s": 120,
                                                "start_timeout_s": start_timeout_s, "sync_bucket_mb": 0.25,
                                                **serving})
    engine = EngineSpec(name, str(ensure_built("tiny")), options)
    return RemoteEngines(RolloutWorkerSpec(engine, **spec), workers=workers)


def scaled_mlps(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Another model: every MLP weight x 1.05 (moves most greedy continuations of the nine requests)."""
    return [(k, v * 1.05 if ".mlp." in k else v) for k, v in state.items()]
