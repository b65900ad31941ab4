"""Two Ray workers with the actor sharded by FSDP2 (gloo, CPU) take the same GRPO step as the single-process actor.

Both sides run in float64 so that only the summation order differs (float32 AdamW amplifies rounding in near-zero
gradients: its first step is about lr * sign(grad)). Tolerance on the updated weights: 1e-9 with lr 1e-3, i.e. a
millionth of one step's change; a wrong loss normalisation or a lost rank's gradient is off by ~lr.
"""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.config import MoEConfig
from vlmrl.actor.local import Actor
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.batch.padding import required_batch_multiple, upsample_to_multiple
from vlmrl.config import ActorConfig, OptimConfig
from vlmrl.distributed.group import ClusterSpec, DistributedActor
from vlmrl.distributed.worker import WorkerSpec
from vlmrl.rollout.base import BackendOptions

pytestmark = pytest.mark.ray
WEIGHT_ATOL = 1e-9


def actor_config(model_path: str, micro: int, **overrides) -> ActorConfig:
    """The per-row vision encoding unless a test asks for sharing (actor.share_vision): dp=2 then equals dp=1 to the
    summation order. With sharing the tower's gradients agree to float32 rounding (transformers rotates the tower's
    queries and keys in float32), which test_dp2_step_matches_dp1 allows for."""
    config = ActorConfig(model_path=model_path, optim=OptimConfig(lr=1e-3, weight_decay=0.01),
                         ppo_micro_batch_size_per_gpu=micro, device="cpu", dtype="float32", share_vision=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def start_dp2(config: ActorConfig, mini_batch_samples: int, **spec) -> DistributedActor:
    config.dtype = "float64"
    return DistributedActor(ClusterSpec(n_gpus_per_node=2),
                            WorkerSpec(actor=config, torch_threads=1, timeout_s=120, **spec), mini_batch_samples,
                            timeout_s=300)


def single_process(config: ActorConfig, mini_batch_samples: int) -> Actor:
    actor = Actor(config, total_steps=1, mini_batch_samples=mini_batch_samples)
    actor.model.double()  # float64 like the workers (the optimizer holds the same parameter objects)
    if actor.reference is not None:
        actor.reference.double()
    if actor.routing is not None:  # as the workers load a float64 MoE model (vlmrl.actor.policy.load_policy)
        actor.model.set_experts_implementation("eager")
    return actor


def perturbed(logprobs: torch.Tensor, batch, seed: int = 0) -> torch.Tensor:
    """Old logprobs a little off the current policy, so that PPO ratios differ from 1 and clipping happens."""
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (logprobs.double() + 0.05 * noise) * batch.response_mask


TOWER_ATOL = 1e-5
"""The same with the vision encoding shared (actor.share_vision) on one side and per row on the other: the tower's
gradients then differ by float32 rounding (~1e-7 of their scale), which AdamW's first step (about lr x g / (|g| +
eps)) turns into at most about lr x rounding / eps = 1e-5 where a gradient is near eps; a lost rank's gradient or
a wrong normalisation is off by ~lr = 1e-3."""


def assert_same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], start: dict,
                        atol: float = WEIGHT_ATOL) -> None:
    assert expected.keys() == got.keys()
    moved = max(float((expected[k].double() - start[k].double()).abs().max()) for k in expected)
    assert moved > 1e-4, "the step did not change the weights: nothing was compared"
    for name, tensor in expected.items():
        diff = float((tensor.double() - got[name].double()).abs().max())
        assert diff <= atol, f"{name}: dp=2 differs from dp=1 by {diff:.3g} (one step moved up to {moved:.3g})"


def assert_same_metrics(expected: dict[str, float], got: dict[str, float], grad_norm_rel: float = 1e-6) -> None:
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy_loss"):
        if key in expected:
            rel = grad_norm_rel if key == "actor/grad_norm" else 1e-6
            assert got[key] == pytest.approx(expected[key], rel=rel, abs=1e-9), key


def test_dp2_step_matches_dp1(ray_cluster, tiny_model_path, processor, synthetic_rows):
    # 4 prompts x 2 samples, prompts 1 and 3 text-only: each rank's slice mixes image and text rows; two optimizer
    # steps of 4 rows; KL to a sharded reference and an entropy bonus; micro-batches of 1 (dp=2) vs 3 (dp=1), the
    # vision encoding shared (the default): dp=1's micro-batches hold both samples of a prompt and encode its image
    # once, dp=2's encode per row
    batch = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(1, 3))
    extra = dict(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01, share_vision=True)
    reference = single_process(actor_config(tiny_model_path, micro=3, **extra), mini_batch_samples=4)
    start = dict(reference.named_tensors())
    start = {k: v.clone() for k, v in start.items()}
    with start_dp2(actor_config(tiny_model_path, micro=1, **extra), mini_batch_samples=4) as dp2:
        old, _ = dp2.compute_logprobs(batch)
        ref_lp, _ = dp2.compute_logprobs(batch, reference=True)
        expected_old, _ = reference.compute_logprobs(batch)
        assert torch.allclose(old, expected_old, atol=1e-6), "logprobs from the shards differ from dp=1"
        old = perturbed(old, batch)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        got = dp2.update(batch, old, advantages, ref_lp.double())
        weights = dict(dp2.full_model().state_dict())  # what a checkpoint saves
        optimizer = dp2.state_dict()["optimizer"]["state"]
    expected = reference.update(batch, old, advantages, ref_lp.double())
    assert expected["actor/pg_clipfrac"] > 0 and expected["actor/kl_loss"] > 0
    assert_same_metrics(expected, got, grad_norm_rel=1e-6)
    # two optimizer steps: the first step's tower rounding reaches every weight the second step moves
    assert_same_weights(dict(reference.named_tensors()), weights, start, atol=TOWER_ATOL)
    assert (expected["actor/vision_items"], got["actor/vision_items"]) == (4.0, 4.0)  # summed over the ranks
    assert expected["actor/vision_items_encoded"] == 2.0 and got["actor/vision_items_encoded"] == 4.0
    # the optimizer state is gathered whole (resumable on any dp size) and equals the single-process moments
    for name, param in reference.model.named_parameters():
        moments = optimizer["model." + name]
        mine = reference.optimizer.state[param]["exp_avg"]
        assert torch.allclose(moments["exp_avg"], mine, atol=1e-6 * float(mine.abs().max()) + 1e-12), name


def test_batch_that_does_not_divide_gets_padding_rows_and_matches_dp1_on_the_real_rows(
        ray_cluster, tiny_model_path, processor, synthetic_rows):
    # 3 prompts x 2 = 6 rows, mini-batches of 4: upsampled to 8 with 2 padding rows. Rank 1's slice of the second
    # mini-batch is ONLY padding rows (no token, no image), yet it must run its forward/backward with rank 0.
    real = make_batch(processor, synthetic_rows[4:7], n=2, text_only_rows=(1,), seed=1)
    multiple = required_batch_multiple(dp_size=2, ppo_mini_batch_size=2, rollout_n=2)
    batch = upsample_to_multiple(real, multiple, eos_token_id=processor.eos_token_ids[0],
                                 pad_token_id=processor.pad_token_id)
    assert len(batch) == 8 and batch.is_padding.tolist() == [False] * 6 + [True] * 2

    reference = single_process(actor_config(tiny_model_path, micro=2), mini_batch_samples=4)
    start = {k: v.clone() for k, v in reference.named_tensors()}
    with start_dp2(actor_config(tiny_model_path, micro=2), mini_batch_samples=4) as dp2:
        old, _ = dp2.compute_logprobs(batch)
        assert float(old[6:].abs().sum()) == 0, "padding rows have no policy token"
        old = perturbed(old, batch, seed=1)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        got = dp2.update(batch, old, advantages)
        weights = dict(dp2.named_tensors())
        # a resume reloads the optimizer state (gathered, then broadcast back into the shards): the next step
        # must continue exactly as without the round trip
        dp2.load_state_dict(dp2.state_dict())
        dp2.update(batch, old, advantages)
        weights_after_resume = dict(dp2.named_tensors())
    assert advantages[6:].abs().sum() == 0

    # dp=1 on the REAL rows only, no padding at all: the same two optimizer steps (rows 0-3, then rows 4-5)
    first = reference.update(_rows(real, range(4)), old[:4], advantages[:4])
    reference.mini_batch_samples = 2
    second = reference.update(_rows(real, range(4, 6)), old[4:6], advantages[4:6])
    assert got["actor/grad_norm"] == pytest.approx((first["actor/grad_norm"] + second["actor/grad_norm"]) / 2,
                                                   rel=1e-6)
    assert_same_weights(dict(reference.named_tensors()), weights, start)
    reference.mini_batch_samples = 4
    reference.update(_rows(real, range(4)), old[:4], advantages[:4])
    reference.mini_batch_samples = 2
    reference.update(_rows(real, range(4, 6)), old[4:6], advantages[4:6])
    assert_same_weights(dict(reference.named_tensors()), weights_after_resume, start)


# One dp=2 run per non-default aggregation mode, each with another policy loss (token-mean / ppo-clip is above).
# seq-mean-token-sum and seq-mean-token-mean are variants (marker `full`, make test-all): make test keeps
# seq-mean-token-sum-norm (a sequence mode with the global normaliser and another loss), and every mode's global
# normaliser across ranks is checked in tests/distributed/test_sharding.py.
SHARDED_MODES = [
    pytest.param("seq-mean-token-sum", "ppo-clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
                 id="seq-mean-token-sum-ppo-clip", marks=pytest.mark.full),
    pytest.param("seq-mean-token-mean", "gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
                 id="seq-mean-token-mean-gspo", marks=pytest.mark.full),
    pytest.param("seq-mean-token-sum-norm", "cispo", dict(clip_ratio_low=1.0, clip_ratio_high=0.2),
                 id="seq-mean-token-sum-norm-cispo")]


@pytest.mark.parametrize("mode, loss, clips", SHARDED_MODES)
def test_dp2_matches_dp1_in_every_mode_with_padding_rows_and_correction_weights(
        ray_cluster, tiny_model_path, processor, synthetic_rows, mode, loss, clips):
    # 6 real rows + 2 padding rows: rank 1's slice of the second mini-batch has no sequence at all, and the
    # global mini-batch's sequence count (2) equals the world size; rollout-correction weights ride along
    real = make_batch(processor, synthetic_rows[4:7], n=2, text_only_rows=(1,), seed=1)
    batch = upsample_to_multiple(real, 8, eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)
    extra = dict(loss_agg_mode=mode, policy_loss=loss, entropy_coeff=0.01, **clips)
    weights = (0.5 + torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(3),
                                dtype=torch.float64)) * batch.response_mask
    reference = single_process(actor_config(tiny_model_path, micro=4, **extra), mini_batch_samples=4)
    start = {k: v.clone() for k, v in reference.named_tensors()}
    with start_dp2(actor_config(tiny_model_path, micro=1, **extra), mini_batch_samples=4) as dp2:
        old, _ = dp2.compute_logprobs(batch)
        old = perturbed(old, batch, seed=3)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        got = dp2.update(batch, old, advantages, loss_weights=weights)
        weights_dp2 = dict(dp2.named_tensors())
    expected = reference.update(batch, old, advantages, loss_weights=weights)
    assert_same_metrics(expected, got)
    for key in ("actor/ratio_min", "actor/ratio_max", "actor/pg_clipfrac_high", "actor/entropy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert_same_weights(dict(reference.named_tensors()), weights_dp2, start)


# Qwen3.5 is a variant (marker `full`, make test-all): the third family of the same step; its text-only forward runs
# the tower and gives every vision tensor a gradient in tests/distributed/test_vision.py (in make test). Qwen3-VL-MoE:
# dp=2 == dp=1 with FSDP2 over the fused expert tensors and the routers; it is Qwen3-VL with experts (the same tower,
# three deepstack mergers, the same text-only rank), so the dense Qwen3-VL case is a variant (`full`) beside it.
# GLM-4.1V: its tower (learned position embeddings, the downsample convolution) on a text-only rank. InternVL3.5: a
# dummy tile through InternViT and the projector outside the tower, 1-D positions.
@pytest.mark.parametrize("tiny_family", ["tiny", pytest.param("tiny-qwen3-vl", marks=pytest.mark.full),
                                         pytest.param("tiny-qwen3.5", marks=pytest.mark.full), "tiny-qwen3-vl-moe",
                                         "tiny-glm4v", "tiny-internvl"],
                         indirect=True)
def test_a_rank_with_only_text_rows_and_a_rank_with_images_complete_the_step(ray_cluster, tiny_family, synthetic_rows):
    # rank 0: prompts 0-1 with images; rank 1: prompts 2-3 without; one mini-batch. Without the dummy vision forward
    # on rank 1 its workers abort in the first sharded forward (gloo collective mismatch). Both families: Qwen3-VL's
    # deepstack mergers must join rank 1's backward too.
    # A MoE model also replays its routing (actor.moe.routing_replay=trainer): each rank records its rows' routing in
    # the old pass, the driver gathers it in batch order and the update's shards carry it to their ranks.
    model_path, processor = tiny_family
    moe = processor.family.experts is not None
    # The vision encoding is shared (actor.share_vision): rank 0's one micro-batch holds both samples of prompts 0
    # and 1, as dp=1's does, so FSDP2 runs the tower once per image on the rank that has images.
    overrides = {"moe": MoEConfig(routing_replay="trainer")} if moe else {}
    overrides["share_vision"] = True
    batch = make_batch(processor, synthetic_rows[8:12], n=2, text_only_rows=(2, 3), seed=2)
    assert all(batch.multi_modal_inputs[i] for i in range(4)) and not any(batch.multi_modal_inputs[4:])
    reference = single_process(actor_config(model_path, micro=4, **overrides), mini_batch_samples=8)
    assert (reference.routing is not None) == moe
    start = {k: v.clone() for k, v in reference.named_tensors()}
    if moe:
        alone = _rows(batch, range(len(batch)))
        reference.compute_logprobs(alone, record_routing=True)
    with start_dp2(actor_config(model_path, micro=4, **overrides), mini_batch_samples=8) as dp2:
        old, _ = dp2.compute_logprobs(batch, record_routing=moe)
        old = perturbed(old, batch, seed=2)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        got = dp2.update(batch, old, advantages)
        weights = dict(dp2.named_tensors())
    if moe:  # the two ranks' recorded routing, gathered, is the one process's, row by row
        assert batch.routed_experts is not None and len(batch.routed_experts) == len(batch)
        for row, (mine, theirs) in enumerate(zip(alone.routed_experts, batch.routed_experts)):
            assert (mine is None) == (theirs is None), row
            assert mine is None or torch.equal(mine, theirs), f"row {row}: dp=2 recorded other experts"
    expected = reference.update(batch, old, advantages)
    assert_same_metrics(expected, got)
    items, encoded = (4.0, 2.0) if processor.family.inputs.image_layout == "patches" else (  # tiles: each tile an item
        sum(len(mm["pixel_values"]) for mm in batch.multi_modal_inputs if mm),
        sum(len(mm["pixel_values"]) for mm in batch.multi_modal_inputs[::2] if mm))  # a prompt's 2 samples share
    assert got["actor/vision_items"] == expected["actor/vision_items"] == items
    assert got["actor/vision_items_encoded"] == expected["actor/vision_items_encoded"] <= encoded
    if moe:  # replayed on both sides: the counts are the global batch's (summed over ranks), equal to one process's
        for key in ("mismatch/routing_changed_frac", "mismatch/routing_changed_tokens_frac"):
            assert got[key] == pytest.approx(expected[key], abs=1e-12), key
    assert_same_weights(dict(reference.named_tensors()), weights, start)
    moved = {n for n in weights if any(v in n for v in ("visual", "vision_tower"))
             and not torch.equal(weights[n], start[n])}
    assert moved, "the images on rank 0 should have trained the vision tower"
    mergers = {n for n in weights if "deepstack_merger_list" in n}
    assert mergers <= moved, f"deepstack mergers the step left untouched: {sorted(mergers - moved)}"
    # a MoE model: FSDP2 shards the fused (experts, ...) tensors and the routers like any weight; every layer's
    # experts and router trained, equal to one process (assert_same_weights above)
    experts = {n for n in weights if ".mlp.experts." in n or ".mlp.gate." in n}
    untouched = {n for n in experts if torch.equal(weights[n], start[n])}
    assert not untouched, f"MoE tensors the step left untouched: {sorted(untouched)}"


def _rows(batch, rows):
    return batch.select(rows)


# A variant (marker `full`, make test-all): make test keeps two colocated vLLM engines generating in parallel and
# taking the fit loop's syncs (tests/trainer/test_fit.py, the two-device step at TP 1), a sync from the shards into
# each TP rank (tests/distributed/test_tensor_parallel.py) and the generic driver path into one engine of two
# (test_the_weight_probe_asks_every_engine_and_names_one_its_sync_missed below).
@pytest.mark.full
def test_colocated_engines_generate_in_parallel_and_receive_the_updated_weights(
        ray_cluster, tiny_model_path, processor, synthetic_rows):
    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.worker import EngineSpec
    from vlmrl.rollout.registry import get_backend
    from vlmrl.types import SamplingParams

    rows = [dict(row, prompt=[{"role": "user", "content": "Say a colour."}], images=[]) if i % 2 else row
            for i, row in enumerate(synthetic_rows[12:16])]
    requests = [processor.build_request(row, i) for i, row in enumerate(rows)]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    engine = EngineSpec("hf", tiny_model_path, BackendOptions.from_kwargs(
        "hf", {"dtype": "float32", "max_model_len": 128, "timeout_s": 120}))
    config = actor_config(tiny_model_path, micro=4, optim=OptimConfig(lr=1e-2, weight_decay=0.0))
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2, engine_placement="worker"),
                             WorkerSpec(actor=config, engine=engine, torch_threads=1, timeout_s=120),
                             mini_batch_samples=8, timeout_s=300)
    with ColocatedEngines(actor) as engines:
        assert actor.hosts == [0, 1]
        first = engines.generate(requests, sampling)  # requests 0-1 on rank 0's engine, 2-3 on rank 1's
        assert [r.uid for r in first] == [q.uid for q in requests for _ in range(2)]
        # Requests 1 and 3 are the same text prompt, each second in its engine's run: seeded, every request draws
        # what one engine would draw for the whole batch (not the other engine's samples for the same prompt).
        with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=128, timeout_s=120) as one:
            alone = one.generate(requests, sampling)
        assert [r.response_ids for r in first] == [r.response_ids for r in alone]
        assert [r.response_ids for r in first[2:4]] != [r.response_ids for r in first[6:8]]
        batch = _batch_of(processor, requests, first)
        start, _ = actor.compute_logprobs(batch)
        assert _max_gap(start, batch) < 1e-4, "engines and actor must start from the same weights"

        advantages = torch.tensor([1.0, -1.0] * 4)
        actor.update(batch, None, advantages)
        moved, _ = actor.compute_logprobs(batch)
        assert _max_gap(moved, batch) > 1e-2, "the update should move the policy (else nothing is tested)"

        assert actor.sync_weights(engines) > 0  # gathered from the shards inside the workers
        second = engines.generate(requests, sampling)
        batch = _batch_of(processor, requests, second)
        assert _max_gap(actor.compute_logprobs(batch)[0], batch) < 1e-4, "engines did not get the new weights"

        actor.update(batch, None, advantages)
        engines.update_weights(actor.named_tensors())  # the fit loop's generic path, through the driver
        third = engines.generate(requests, sampling)
        batch = _batch_of(processor, requests, third)
        assert _max_gap(actor.compute_logprobs(batch)[0], batch) < 1e-4, "update_weights did not reach the engines"


def test_dp2_lora_sync_streams_merged_weights_into_each_ranks_engine(ray_cluster, tiny_model_path, processor,
                                                                      synthetic_rows):
    """LoRA (language model + merger) at dp=2 with an engine on each rank: `sync_weights` gathers the shards, merges
    each layer as its bucket fills and streams it in buckets of 0.25 MiB (rollout.sync_bucket_mb) into the rank's
    engine; the engines then compute the trained policy's logprobs."""
    from vlmrl.config import LoraConfig
    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.worker import EngineSpec
    from vlmrl.types import SamplingParams

    rows = [dict(row, prompt=[{"role": "user", "content": "Say a colour."}], images=[]) if i % 2 else row
            for i, row in enumerate(synthetic_rows[12:16])]
    requests = [processor.build_request(row, i) for i, row in enumerate(rows)]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    engine = EngineSpec("hf", tiny_model_path, BackendOptions.from_kwargs(
        "hf", {"dtype": "float32", "max_model_len": 128, "timeout_s": 120, "sync_bucket_mb": 0.25}))
    config = actor_config(tiny_model_path, micro=4, optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                          lora=LoraConfig(rank=4, alpha=8, vision="merger"))
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2, engine_placement="worker"),
                             WorkerSpec(actor=config, engine=engine, torch_threads=1, timeout_s=120),
                             mini_batch_samples=8, timeout_s=300)
    with ColocatedEngines(actor) as engines:
        batch = _batch_of(processor, requests, engines.generate(requests, sampling))
        assert _max_gap(actor.compute_logprobs(batch)[0], batch) < 1e-4, "B = 0: the engines start at the policy"
        actor.update(batch, None, torch.tensor([1.0, -1.0] * 4))
        moved, _ = actor.compute_logprobs(batch)
        assert _max_gap(moved, batch) > 1e-2, "the update should move the policy (else nothing is tested)"
        assert actor.sync_weights(engines) > 0
        batch = _batch_of(processor, requests, engines.generate(requests, sampling))
        assert _max_gap(actor.compute_logprobs(batch)[0], batch) < 1e-4, "the engines did not get the merged weights"


def _batch_of(processor, requests, results):
    from vlmrl.batch.padding import pad_sample, stack_samples

    samples = []
    for i, result in enumerate(results):
        prompt = processor.prompt_inputs(requests[i // 2])
        samples.append(pad_sample(prompt, result.response_ids, prompt_length=64, response_length=4,
                                  pad_token_id=processor.pad_token_id, rollout_logprobs=result.response_logprobs))
    return stack_samples(samples)


def _max_gap(logprobs: torch.Tensor, batch) -> float:
    """Largest |trainer - engine| logprob over the policy tokens."""
    return float(((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).max())


# "merger" is a variant (marker `full`, make test-all): make test keeps "tower+merger", which has the merger's adapters
# (in FSDP's root unit) and the tower's.
@pytest.mark.parametrize("vision", [pytest.param("merger", marks=pytest.mark.full), "tower+merger"])
def test_dp2_lora_step_matches_dp1(ray_cluster, tiny_model_path, processor, synthetic_rows, tmp_path, vision):
    """LoRA (language model + the vision side) sharded over two ranks: the same adapters from the same seed on every
    rank, the adapters-off reference from the shards, and after a GRPO step with the KL loss the same adapters and
    merged weights as one process, to the non-LoRA test's tolerance. The merger's adapters sit in FSDP's root unit,
    which stays unsharded after the no-grad reference pass: they must still train (`adapters_disabled`)."""
    from safetensors.torch import load_file

    from vlmrl.actor.lora import ADAPTER_DIR, ADAPTER_WEIGHTS
    from vlmrl.config import LoraConfig

    batch = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(1, 3))
    extra = dict(use_kl_loss=True, kl_loss_coef=0.1, lora=LoraConfig(rank=4, alpha=8, vision=vision))
    reference = single_process(actor_config(tiny_model_path, micro=3, **extra), mini_batch_samples=4)
    start = {k: v.clone() for k, v in reference.named_tensors()}
    with start_dp2(actor_config(tiny_model_path, micro=1, **extra), mini_batch_samples=4) as dp2:
        dp2.save_adapter(tmp_path / "before")
        ref_lp, _ = dp2.compute_logprobs(batch, reference=True)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        old = perturbed(dp2.compute_logprobs(batch)[0], batch)
        got = dp2.update(batch, old, advantages, ref_lp.double())
        weights = dict(dp2.full_model().state_dict())
        dp2.save_adapter(tmp_path / "after")
    ours_before = load_file(tmp_path / "before" / ADAPTER_DIR / ADAPTER_WEIGHTS)
    reference.save_adapter(tmp_path / "dp1-before")
    assert all(torch.equal(t.double(), load_file(tmp_path / "dp1-before" / ADAPTER_DIR / ADAPTER_WEIGHTS)[k].double())
               for k, t in ours_before.items()), "the ranks' adapters start elsewhere than dp=1's"
    expected_ref, _ = reference.compute_logprobs(batch, reference=True)
    assert torch.allclose(ref_lp, expected_ref, atol=1e-9), "the adapters-off reference differs from dp=1"
    expected = reference.update(batch, old, advantages, ref_lp.double())
    assert_same_metrics(expected, got)
    reference.save_adapter(tmp_path / "dp1-after")
    adapters = load_file(tmp_path / "after" / ADAPTER_DIR / ADAPTER_WEIGHTS)
    single = load_file(tmp_path / "dp1-after" / ADAPTER_DIR / ADAPTER_WEIGHTS)
    assert adapters.keys() == single.keys() and any(".visual." in k for k in adapters)
    for name, tensor in single.items():
        diff = float((tensor.double() - adapters[name].double()).abs().max())
        assert diff <= WEIGHT_ATOL, f"{name}: dp=2 adapter differs from dp=1 by {diff:.3g}"
    # B starts at 0 and gets the first gradient: every lora_B the images and text reach must have moved
    frozen = [k for k in adapters if ".lora_B." in k and torch.equal(adapters[k], ours_before[k])]
    assert not frozen, f"dp=2 left these adapters untrained: {frozen[:4]}"
    assert any(".merger." in k for k in adapters)
    assert_same_weights(dict(reference.named_tensors()), weights, start)


def test_the_weight_probe_asks_every_engine_and_names_one_its_sync_missed(ray_cluster, tiny_model_path, processor,
                                                                         synthetic_rows):
    """Two colocated engines (dp = 2): the probe request goes to each; after a sync they answer alike and the probe
    is in sync with `weight_probe/engines_agree` 1. Engine 1 alone given other weights (a sync that reached one
    engine group only) is named, at start as the start-up check's error, later per weight_probe_action."""
    import ray

    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.worker import EngineSpec
    from vlmrl.trainer.engine_probe import EngineModelError, WeightProbe, WeightProbeError

    engine = EngineSpec("hf", tiny_model_path, BackendOptions.from_kwargs(
        "hf", {"dtype": "float32", "max_model_len": 256, "timeout_s": 120}))
    config = actor_config(tiny_model_path, micro=4)
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2), WorkerSpec(actor=config, engine=engine, torch_threads=1,
                                                                        timeout_s=120),
                             mini_batch_samples=8, timeout_s=300)
    request = processor.build_request(synthetic_rows[0], 0)
    with ColocatedEngines(actor) as engines:
        probe = WeightProbe(request, processor, tokens=4, prompt_length=128, temperature=1.0, action="error")
        metrics = probe(actor, engines, 0, 0, at_start=True)
        assert metrics["weight_probe/in_sync"] == 1.0 and metrics["weight_probe/engines_agree"] == 1.0
        state = {name: t.clone() for name, t in actor.named_tensors()}
        other = [(name, -t if "layers.1.mlp.down_proj" in name else t) for name, t in state.items()]
        ray.get(actor.workers[1].load_engine_weights.remote(other), timeout=120)
        with pytest.raises(EngineModelError, match="engine 1 answers the probe otherwise than engine 0"):
            probe(actor, engines, 0, 0, at_start=True)
        with pytest.raises(WeightProbeError, match="step 1: weight probe: engine 1 answers the probe otherwise"):
            probe(actor, engines, 1, 1)
        probe.action = "warn"
        assert probe(actor, engines, 1, 1)["weight_probe/engines_agree"] == 0.0
