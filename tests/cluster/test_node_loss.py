"""A rollout node lost mid-run, on a simulated cluster of two 1-CPU rollout nodes: the worker on the lost node is
started again on the remaining one (Ray places its placement group again) with the last synced weights; when no
node is left that can hold it, one error names what the worker needs and what the cluster has."""

from __future__ import annotations

import pytest
import torch

from tests.cluster.conftest import remote_engines, scaled_mlps, simulated_cluster
from tests.rollout.helpers import GREEDY, build_batch
from vlmrl.rollout.errors import RolloutError

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(1, 1) as started:
        yield started


def test_a_lost_rollout_node_moves_its_worker_to_the_remaining_one_then_is_a_named_error(cluster):
    handle, nodes = cluster
    engines = remote_engines("hf", 1, start_timeout_s=20)
    try:
        state = {k: v.detach().clone() for k, v in engines_model_state(engines).items()}
        engines.update_weights(scaled_mlps(state))  # the object store keeps this sync for a restart
        batch = build_batch(engines.processor)[:3]
        before = engines.generate(batch, GREEDY)

        first = engines.infos[0]["node"]
        handle.remove_node(next(node for node in nodes if node.node_id == first))
        after = engines.generate(batch, GREEDY)
        assert engines.restarts == 1 and engines.infos[0]["node"] != first
        assert [(r.response_ids, r.response_logprobs) for r in after] == \
            [(r.response_ids, r.response_logprobs) for r in before], "the moved worker is not on the synced weights"

        handle.remove_node(next(node for node in nodes if node.node_id == engines.infos[0]["node"]))
        engines.restarts_left = 1
        # no node is left: Ray would place the worker's group only on a node that joins within rollout.start_timeout_s
        # (an autoscaled cluster's); the error's wording, not the wait, is what this checks (the wait cost 20 s)
        engines.rollout.start_timeout_s = 3
        with pytest.raises(RolloutError, match=r"cannot hold 1 of 1 rollout workers .*needs \{'CPU': 1\}"):
            engines.generate(batch, GREEDY)
    finally:
        engines.close()


def engines_model_state(engines) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(engines.model_path, dtype=torch.float32).state_dict()
