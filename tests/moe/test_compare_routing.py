"""compare's routing on the embedded Qwen3-VL-MoE with the real vLLM engine and the trainer: the vLLM side's
validation records the routing its own routers computed, the trainer side the routing of its logprob pass; on the
same weights they agree everywhere, and a trainer whose second MoE layer's router moved is told apart by the first
MoE layer that routes differently."""

from __future__ import annotations

import pytest

from tests.alignment.test_compare_engines import write_colour_set
from vlmrl.alignment.artifact import read_artifact
from vlmrl.alignment.causes import Cause
from vlmrl.alignment.diff import compare_artifacts
from vlmrl.alignment.routing import compare_routing, decode_routing

# A variant (marker `full`, make test-all; a vLLM start and two trainer-side actors): the routing cause end to end.
# make test keeps its parts: vLLM's captured routing equal to transformers' and a moved router named by its layer
# (tests/rollout/qwen3_vl_moe/test_vllm.py), the cause in the diff (tests/alignment/test_routing_cause.py), and the
# actor's recording in the logprob pass the trainer side runs (tests/actor/test_router_hooks.py).
pytestmark = [pytest.mark.vllm, pytest.mark.full]


@pytest.fixture(scope="module")
def engine_side(tmp_path_factory, qwen3_vl_moe_path):
    """vLLM's validation artifact (float32, greedy) of 7 rows, its routing captured (what compare asks of a MoE
    model's vllm side)."""
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    root = tmp_path_factory.mktemp("moe_compare")
    common = [f"actor.model_path={qwen3_vl_moe_path}", f"data.val_files={write_colour_set(root)}",
              "data.max_prompt_length=128", "data.max_response_length=8", "rollout.dtype=float32",
              "rollout.val_top_logprobs=5", f"reward.function={root / 'rewards.py'}:by_length", "rollout.timeout_s=300",
              "trainer.val_only=true", "actor.dtype=float32", f"trainer.output_dir={root / 'run'}"]
    config = load_config([*common, "rollout.name=vllm", "rollout.vllm.capture_routing=true"])
    return root, common, validate_with(config, "vllm", artifact_path=root / "vllm.jsonl").artifact_path


def _router_moved(model_path: str, folder, layer: int):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path, folder)
    weights = load_file(folder / "model.safetensors")
    name = f"model.language_model.layers.{layer}.mlp.gate.weight"
    weights[name] = weights[name] + 2.0 * weights[name].std() * torch.randn(
        weights[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_engine_and_the_trainer_route_alike_and_a_moved_router_is_named_by_its_layer(engine_side,
                                                                                         qwen3_vl_moe_path):
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, common, reference = engine_side
    meta_e, engine = read_artifact(reference)
    assert all(r.routing is not None for r in engine), "the vllm side recorded every sample's routing"
    trainer_path = score_reference(load_config([*common, "rollout.name=vllm"]), reference, root / "trainer.jsonl")
    meta_t, trainer = read_artifact(trainer_path)
    for a, b in zip(engine, trainer):
        agreement = compare_routing(decode_routing(a.routing), decode_routing(b.routing))
        assert agreement.first_token is None, agreement.describe()
        assert agreement.tokens == a.expanded_prompt_length + len(a.response_ids) - 1  # every token vLLM ran
    comparison = compare_artifacts(meta_e, engine, meta_t, trainer)
    assert Cause.ROUTING not in comparison.cause_counts and comparison.ok

    moved = _router_moved(qwen3_vl_moe_path, root / "moved", layer=1)
    path = score_reference(load_config([*common, "rollout.name=vllm", f"actor.model_path={moved}"]), reference,
                           root / "moved.jsonl")
    meta_m, scored = read_artifact(path)
    comparison = compare_artifacts(meta_e, engine, meta_m, scored)
    differing = comparison.differing()
    assert differing, "a router moved by 2 std changed no logprob beyond the tolerance"
    # other weights on the trainer side are named first (its header's fingerprint); the routing explains them
    assert all(s.cause == Cause.WEIGHTS_DIFFER for s in differing)
    assert all("the first MoE layer that differs: 1" in s.explanation for s in differing), \
        [s.explanation for s in differing]
