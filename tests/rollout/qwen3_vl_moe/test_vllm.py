"""vLLM (in-process, float32) on the embedded Qwen3-VL-MoE against transformers: its routing captured from the CPU
engine is transformers' routing (a moved router named by its layer), the trainer replays it (routing replay R3), and
a LoRA policy with expert adapters syncs as merged weights. The engine contract (greedy == HF, expert weight sync:
vLLM's CPU MoE kernel repacks the experts on a reload only because vlmrl's worker extension asks it to) is the family
matrix's (tests/rollout/test_family_contract.py)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_qwen3_vl_moe):
    return vllm_qwen3_vl_moe


def test_the_engines_routing_is_transformers_routing(backend, hf, batch):
    """vLLM's own routers, captured on the CPU engine, route every token of the nine requests (expanded prompt and
    response, images included) through transformers' experts in every MoE layer; a pair may differ only where
    transformers' choice was a float32 near-tie (its k-th and (k+1)-th router probabilities within 1e-5)."""
    from vlmrl.alignment.routing import compare_routing, differing_sets, transformers_routing

    pairs = backend.generate_with_routing(batch, GREEDY)
    for request, (result, engine) in zip(batch, pairs):
        ours, margins = transformers_routing(hf, request, result.response_ids[:-1])
        assert engine.shape == ours.shape, "one routing per token the engine ran"
        differs = differing_sets(engine, ours)
        assert (margins[differs] < 1e-5).all(), compare_routing(engine, ours).describe()


def test_a_router_moved_in_the_engine_shows_as_routing_from_its_layer(backend, hf, batch):
    """Only the second MoE layer's router moved in the engine: the comparison with transformers names layer 1 as
    the first whose routing differs, with the first layer's routing untouched."""
    from tests.rollout.moe_contract import moved
    from tests.rollout.helpers import clone_state
    from vlmrl.alignment.routing import compare_routing, differing_sets, transformers_routing

    original = clone_state(hf.model)
    backend.update_weights(moved(original, "layers.1.mlp.gate.weight", scale=2.0).items())
    try:
        ((result, engine),) = backend.generate_with_routing(batch[3:4], GREEDY)
    finally:
        backend.update_weights(original.items())
    ours, _ = transformers_routing(hf, batch[3], result.response_ids[:-1])
    agreement = compare_routing(engine, ours)
    assert agreement.first_layer == 1 and agreement.differing_tokens > 0, agreement.describe()
    assert not differing_sets(engine, ours)[0].any()
    assert "the first MoE layer that differs: 1" in agreement.describe()


def test_engine_routing_replay_scores_with_the_engines_experts(backend, hf, batch):
    """actor.moe.routing_replay=engine (R3): samples drawn with the engine's routing captured, and the trainer's
    logprob pass routed through it. On the same weights the trainer equals the engine's logprobs (float32). With the
    engine's layer-1 router nudged (0.1 std: the top-k flips where two experts nearly tie, as bfloat16 rounding
    flips them, while the mixing weights barely move), the trainer that replays the engine's experts sits closer to
    the engine's logprobs on average than the trainer routing on its own, and reports the share of (token, layer)
    pairs it would route elsewhere."""
    from tests.rollout.moe_contract import moved
    from tests.rollout.helpers import clone_state
    from vlmrl.actor.config import MoEConfig
    from vlmrl.actor.local import Actor
    from vlmrl.batch.padding import pad_results, scored_batch
    from vlmrl.config import ActorConfig
    from vlmrl.types import SamplingParams

    requests = batch[2:6]  # text and images
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    processor = hf.processor

    def rollout():
        backend.rollout.vllm.capture_routing = True
        try:
            results = backend.generate(requests, sampling)
        finally:
            backend.rollout.vllm.capture_routing = False
        assert all(r.routed_experts is not None for r in results)
        samples = pad_results([processor.prompt_inputs(r) for r in requests], results, prompt_length=160,
                              response_length=6, pad_token_id=processor.pad_token_id, policy_version=0)
        return scored_batch(samples, [0.0] * len(samples), [{}] * len(samples), multiple=1,
                            eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)

    def gap(actor, rows):
        logprobs, _ = actor.compute_logprobs(rows)
        return float(((logprobs - rows.rollout_logprobs).abs() * rows.response_mask).sum() / rows.response_mask.sum())

    actors = {mode: Actor(ActorConfig(model_path=backend.model_path, device="cpu", dtype="float32",
                                      moe=MoEConfig(routing_replay=mode)), total_steps=1, mini_batch_samples=8)
              for mode in ("off", "engine")}
    same = rollout()
    assert gap(actors["engine"], same) < 1e-5 and actors["engine"].routing.take_counts()[
        "mismatch/routing_changed_frac"] == 0.0

    original = clone_state(hf.model)
    backend.update_weights(moved(original, "layers.1.mlp.gate.weight", scale=0.1).items())
    try:
        drifted = rollout()
    finally:
        backend.update_weights(original.items())
    replayed, own = gap(actors["engine"], drifted), gap(actors["off"], drifted)
    assert replayed < own, f"replaying the engine's experts did not bring the trainer closer ({replayed} vs {own})"
    assert actors["engine"].routing.take_counts()["mismatch/routing_changed_frac"] > 0


def test_merged_expert_lora_syncs_like_hf_running_the_merged_model(backend, hf, batch):
    """A LoRA policy with adapters on every MoE layer's experts (actor.lora.experts), only the expert adapters
    nonzero: the actor's sync reaches vLLM as merged weights (sync=auto; the adapted tensors, converted to the
    checkpoint's expert layout by the same sync as a full model's), and the engine's greedy outputs equal
    transformers running the merged model, token for token and to float rounding; the originals bring the first
    outputs back."""
    from tests.rollout.moe_contract import expert_lora_actor
    from tests.rollout.helpers import LOGPROB_TOL, clone_state, greedy_problems

    actor = expert_lora_actor(backend.model_path)
    requests = [batch[0], batch[3], batch[6]]  # no image, one, two
    first = backend.generate(requests, GREEDY)
    assert actor.lora_sync.path(backend) == "merged"
    original = clone_state(hf.model)
    try:
        actor.sync_weights(backend)
        hf.update_weights(actor.named_tensors())
        after = backend.generate(requests, GREEDY)
        problems = greedy_problems(hf.generate(requests, GREEDY), after, backend.name, LOGPROB_TOL)
    finally:
        hf.update_weights(original.items())
        backend.update_weights(original.items())
    assert not problems, "engine with merged expert LoRA != HF running the merged model:\n" + "\n".join(problems)
    assert any(a.response_ids != b.response_ids for a, b in zip(first, after)), "the expert adapters changed nothing"
    restored = backend.generate(requests, GREEDY)
    assert [r.response_ids for r in restored] == [r.response_ids for r in first]
