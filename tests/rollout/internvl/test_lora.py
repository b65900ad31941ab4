"""A LoRA policy of the embedded InternVL3.5 in vLLM (fp32, CPU). Language and vision adapters (InternViT's blocks and
the projector after the tower) sync merged into the shared engine: greedy == transformers running the merged model,
and a change of the vision adapters alone reaches images the engine had encoded. vLLM's InternS1 serves LoRA on the
language model, not on the projector or the tower's attention output: a policy with those syncs merged under
sync=auto and is refused under sync=adapter, and a language-only policy is served as the adapter itself."""

from __future__ import annotations

import pytest

from tests.rollout import test_lora_sync
from tests.rollout.test_lora_sync import RANK, check_engine, given_back, set_adapters, sync_and_check
from vlmrl.actor.local import Actor
from vlmrl.config import ActorConfig, LoraConfig

pytestmark = pytest.mark.vllm

# the LoRA sync module's fixtures, this module's own (on this folder's model and HF reference)
policy, requests, merged_hf, base_greedy = (test_lora_sync.policy, test_lora_sync.requests, test_lora_sync.merged_hf,
                                            test_lora_sync.base_greedy)


def test_vllm_takes_merged_weights(vllm_internvl, hf, policy, base_greedy, merged_hf, requests):
    names = {n for n, _ in policy.model.named_parameters() if "lora_B" in n}
    assert any(".vision_tower.encoder.layer." in n for n in names)
    assert any(".multi_modal_projector." in n for n in names)
    assert "projection_layer" in policy.lora_sync.unservable()  # so a LoRA-serving vLLM would get merged weights
    with given_back(vllm_internvl, hf, requests, base_greedy) as engine:
        check_engine(policy, engine, base_greedy, merged_hf, requests, sync="auto", path="merged")


# A variant (marker `full`, make test-all; a vLLM start with LoRA): what vLLM's InternS1 serves as an adapter. make test
# keeps the merged sync above and the adapter path on Qwen2.5-VL (tests/rollout/test_lora_sync.py).
@pytest.mark.full
def test_vllm_serves_language_adapters_and_vision_ones_go_merged(tiny_model_path, policy, base_greedy, merged_hf,
                                                                 requests):
    from vlmrl.rollout.registry import get_backend

    language = Actor(ActorConfig(model_path=tiny_model_path, device="cpu", lora=LoraConfig(rank=RANK, alpha=16)),
                     total_steps=1, mini_batch_samples=1)
    with get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     lora_rank=RANK) as engine:
        assert engine.serves_adapters()
        set_adapters(language, language=0.5, vision=0.0, seed=1)
        served = sync_and_check(language, engine, merged_hf, requests, "auto", "adapter")
        assert any(a.response_ids != b.response_ids for a, b in zip(served, base_greedy))
        policy.lora_sync.lora.sync = "auto"
        assert policy.lora_sync.path(engine) == "merged"
        assert "projection_layer" in policy.lora_sync.unservable()
        policy.lora_sync.lora.sync = "adapter"
        with pytest.raises(ValueError, match="actor.lora.sync=adapter but .* vLLM serves no LoRA on"):
            policy.lora_sync.path(engine)
