"""Splitting batches over data-parallel ranks: every row goes to exactly one rank, each rank's slice of a mini-batch
has the same size, and each slice knows the GLOBAL token count its loss divides by."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.step_metrics import mean_metrics
from vlmrl.batch.padding import required_batch_multiple, upsample_to_multiple
from vlmrl.distributed.layout import EngineLayout
from vlmrl.distributed.sharding import (
    even_row_blocks,
    update_row_blocks,
    update_shards,
)


@pytest.mark.parametrize("rows, mini, world", [(8, 4, 2), (24, 12, 4), (12, 12, 3), (6, 2, 1)])
def test_update_blocks_give_each_rank_an_equal_slice_of_every_mini_batch(rows, mini, world):
    blocks = update_row_blocks(rows, mini, world)
    assert sorted(r for block in blocks for r in block) == list(range(rows))
    local = mini // world
    for block in blocks:
        assert len(block) == rows // world
        for m, start in enumerate(range(0, len(block), local)):
            # the rank's m-th optimizer step uses rows of global mini-batch m only
            assert all(m * mini <= r < (m + 1) * mini for r in block[start: start + local])


def test_uneven_batches_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="padding rows"):
        even_row_blocks(7, 2)
    with pytest.raises(ValueError, match="padding rows"):
        update_row_blocks(6, 4, 2)
    with pytest.raises(ValueError, match="multiple of the dp size"):
        update_row_blocks(6, 3, 2)


def test_shards_carry_the_global_token_count_and_keep_padding_rows_apart(processor, synthetic_rows):
    batch = make_batch(processor, synthetic_rows[:3], n=2, text_only_rows=(1,))  # 6 rows
    padded = upsample_to_multiple(batch, required_batch_multiple(2, 2, 2), eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    assert len(padded) == 8 and int(padded.is_padding.sum()) == 2
    old = torch.randn(padded.response_mask.shape)
    shards = update_shards(padded, old, torch.arange(8.0), None, mini_batch_rows=4, world_size=2)
    expected_tokens = [float(padded.response_mask[:4].sum()), float(padded.response_mask[4:].sum())]
    for rank, shard in enumerate(shards):
        assert shard.mini_batch_tokens == expected_tokens
        assert shard.mini_batch_normalisers == expected_tokens  # token-mean: the normaliser is the token count
        assert shard.local_mini_batch == 2 and len(shard.batch) == 4
    # rank 1 holds rows 2, 3 (mini-batch 0) and 6, 7: the two padding rows, with no image and no policy token
    assert shards[1].advantages.tolist() == [2.0, 3.0, 6.0, 7.0]
    assert shards[1].batch.is_padding.tolist() == [False, False, True, True]
    assert shards[1].batch.multi_modal_inputs[2:] == [{}, {}]
    assert float(shards[1].batch.response_mask[2:].sum()) == 0
    assert torch.equal(shards[1].old_logprobs, old[[2, 3, 6, 7]])


@pytest.mark.parametrize("mode, per_sequence", [("seq-mean-token-sum", 1), ("seq-mean-token-mean", 1),
                                                ("seq-mean-token-sum-norm", None)])
def test_shards_carry_the_global_normaliser_of_the_sequence_modes(processor, synthetic_rows, mode, per_sequence):
    batch = make_batch(processor, synthetic_rows[:3], n=2, text_only_rows=(1,))
    padded = upsample_to_multiple(batch, 8, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    weights = torch.rand(padded.response_mask.shape)
    shards = update_shards(padded, None, torch.zeros(8), None, mini_batch_rows=4, world_size=2, loss_agg_mode=mode,
                           loss_weights=weights)
    per_sequence = per_sequence or padded.response_mask.shape[1]  # -norm: sequences x max_response_length
    # mini-batch 0: 4 real sequences; mini-batch 1: 2 real and the 2 padding rows, which count for nothing
    assert shards[0].mini_batch_normalisers == [4.0 * per_sequence, 2.0 * per_sequence]
    assert shards[1].mini_batch_normalisers == shards[0].mini_batch_normalisers
    assert torch.equal(shards[1].loss_weights, weights[[2, 3, 6, 7]])


def test_select_takes_every_per_row_field(processor, synthetic_rows):
    batch = make_batch(processor, synthetic_rows[:2], n=2, text_only_rows=(1,))
    batch.engines = [0, 0, 1, 1]  # a run with two engines tags each row with the one that sampled it
    picked = batch.select([3, 0])
    assert picked.engines == [1, 0]
    assert picked.uids == [batch.uids[3], batch.uids[0]]
    assert torch.equal(picked.input_ids, batch.input_ids[[3, 0]])
    assert torch.equal(picked.position_ids, batch.position_ids[[3, 0]])
    assert picked.multi_modal_inputs[0] == {} and "pixel_values" in picked.multi_modal_inputs[1]
    assert picked.prompt_length == batch.prompt_length


def test_metric_parts_average_over_ranks():
    assert mean_metrics([{"a": 1.0, "g": 2.0}, {"a": 3.0, "g": 2.0}]) == {"a": 2.0, "g": 2.0}
    assert mean_metrics([{"a": 1.0, "b": 4.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}  # a rank without b: 0
    # ratio extremes are extremes over ranks (a rank without tokens reports the identities +-inf)
    ranks = [{"actor/ratio_min": 0.9, "actor/ratio_max": 1.2}, {"actor/ratio_min": float("inf"),
                                                                 "actor/ratio_max": float("-inf")}]
    assert mean_metrics(ranks) == {"actor/ratio_min": 0.9, "actor/ratio_max": 1.2}


def test_engines_go_on_every_worker_or_on_the_first_worker_of_each_node():
    nodes = ("node-a", "node-a", "node-b", "node-b")
    assert EngineLayout(dp=4, engine="vllm", nodes=nodes).hosts == [0, 1, 2, 3]
    assert EngineLayout(dp=4, engine="vllm", placement="node", nodes=nodes).hosts == [0, 2]
    with pytest.raises(ValueError, match="worker or node"):
        EngineLayout(dp=4, engine="vllm", placement="gpu", nodes=nodes)


def test_a_tensor_parallel_engine_spans_consecutive_ranks():
    """verl's layout: engine g on ranks [g*k, (g+1)*k); vLLM builds a TP rank in each of them (spmd), SGLang one
    engine on the group's first rank; requests go to each group's first rank; k must divide dp."""
    vllm, sglang = EngineLayout(dp=8, tp=4, engine="vllm"), EngineLayout(dp=8, tp=4, engine="sglang")
    assert vllm.groups == sglang.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert vllm.leaders == sglang.leaders == [0, 4] and sglang.hosts == [0, 4] and vllm.hosts == list(range(8))
    assert [vllm.tp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3] and vllm.group_of(5) == 1
    assert not EngineLayout(dp=8, tp=1, engine="vllm").spmd and EngineLayout(dp=2, engine=None).groups == []
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=3 must divide the 4 training ranks"):
        EngineLayout(dp=4, tp=3, engine="vllm")
    with pytest.raises(ValueError, match="engine_placement=node runs one single-device engine per node"):
        EngineLayout(dp=4, tp=2, engine="vllm", placement="node", nodes=("a", "a", "b", "b"))
