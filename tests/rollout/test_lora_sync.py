"""A LoRA policy's weights in the real engines (fp32, CPU): after `Actor.sync_weights`, each engine's greedy output
equals the transformers model with the adapters merged, on 8 requests with images; language-model and vision
(tower + merger) adapters together.

Paths (actor.lora.sync): (a) merged weights on every backend - vLLM takes the full state dict, SGLang (Engine and HTTP
server) and hf only the adapted layers where they take partial updates; (b) the adapter itself on vLLM (started with enable_lora and
enable_tower_connector_lora). SGLang cannot serve adapters on CPU (its LoRA memory pool needs pinned memory, i.e. an
accelerator), so `auto` falls back to merged there and says so once. Merged syncs stream in small buckets
(rollout.sync_bucket_mb) and must land exactly as HF's one-bucket load of the merged model. After a sync that changes only the vision
adapters, a request whose image the engine has already encoded must come out as the new weights compute it (the
engines' encoder caches are reset or keyed by weight version)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from tests.rollout.helpers import GREEDY, clone_state, greedy_mismatch, noise_image
from vlmrl.actor.local import Actor
from vlmrl.config import ActorConfig, LoraConfig

RANK = 8
BUCKET_MB = 0.25
"""Merged syncs in buckets of 0.25 MiB (rollout.sync_bucket_mb; the tiny model is 3.4 MB): a dozen buckets, layers
split across them; the HF reference loads the merged model in one."""


VISION_NAMES = (".visual.", ".vision_tower.", ".multi_modal_projector.")
"""The vision side's parameter names: Qwen's and GLM's tower (mergers inside), InternVL's tower and projector."""


def image_requests(processor) -> list:
    """Eight requests, each with one or two images of different sizes (built by the real processor)."""
    specs = [("<image>What is in the picture?", [(112, 112)]), ("Describe <image> briefly.", [(200, 90)]),
             ("<image>Count the shapes.", [(60, 150)]), ("<image><image>Which image is brighter?", [(112, 84), (70, 70)]),
             ("Compare <image> with <image>.", [(168, 56), (90, 120)]), ("<image>Name its colour.", [(84, 84)]),
             ("<image>First, then <image> second.", [(56, 56), (150, 100)]), ("Where is the dot? <image>", [(140, 56)])]
    rows = [{"data_source": "lora-test", "prompt": [{"role": "user", "content": text}],
             "images": [noise_image(w, h, seed=100 + 10 * i + k) for k, (w, h) in enumerate(sizes)]}
            for i, (text, sizes) in enumerate(specs)]
    return [processor.build_request(row, index=i) for i, row in enumerate(rows)]


def set_adapters(actor: Actor, language: float, vision: float, seed: int) -> None:
    """Seeded random lora_B (A is PEFT's random init): `language` scales the language model's, `vision` the tower's
    and merger's (0 = that side computes the base model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in actor.model.named_parameters():
            if "lora_B" in name:
                scale = vision if any(v in name for v in VISION_NAMES) else language
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def policy(tiny_model_path) -> Actor:
    config = ActorConfig(model_path=tiny_model_path, device="cpu",
                         lora=LoraConfig(rank=RANK, alpha=16, vision="tower+merger"))
    return Actor(config, total_steps=1, mini_batch_samples=1)


@pytest.fixture(scope="module")
def requests(hf):
    return image_requests(hf.processor)


@pytest.fixture(scope="module")
def merged_hf(tiny_model_path):
    """A transformers backend of its own: the merged model's greedy outputs are read from it."""
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend


def hf_merged_greedy(policy: Actor, merged_hf, requests) -> list:
    policy.lora_sync.lora.sync = "merged"
    policy.sync_weights(merged_hf)
    return merged_hf.generate(requests, GREEDY)


def assert_equal_to_hf(results, expected, backend: str) -> None:
    problems = [message for ref, got in zip(expected, results) if (message := greedy_mismatch(ref, got, backend))]
    assert not problems, "\n".join(problems)


def sync_and_check(policy: Actor, engine, merged_hf, requests, sync: str, path: str) -> list:
    """Sync the policy into `engine` by `sync`, check the path taken, and that its greedy outputs equal HF merged's."""
    expected = hf_merged_greedy(policy, merged_hf, requests)
    policy.lora_sync.lora.sync = sync
    assert policy.lora_sync.path(engine) == path
    policy.sync_weights(engine)
    results = engine.generate(requests, GREEDY)
    assert_equal_to_hf(results, expected, f"{engine.name} ({path})")
    return results


def check_engine(policy: Actor, engine, base_greedy, merged_hf, requests, sync: str, path: str) -> None:
    """Both adapters on: == HF merged and != the base model; then only the vision adapters change, and the same
    requests (images already encoded by the engine) follow."""
    set_adapters(policy, language=0.5, vision=0.0, seed=1)
    if path == "merged":  # streamed in buckets (HF's reference takes one): layers merged as their bucket fills
        from vlmrl.actor.lora import merged_tensors

        engine.rollout.sync_bucket_mb = BUCKET_MB
        sent = merged_tensors(policy.model.state_dict().items(), policy.lora_sync.scaling,
                              changed_only=engine.accepts_partial_weights)
        assert len(list(engine.sync_plan(sent).buckets)) >= 4, "too few buckets: nothing bucketed was tested"
    first = sync_and_check(policy, engine, merged_hf, requests, sync, path)
    assert any(a.response_ids != b.response_ids for a, b in zip(first, base_greedy)), \
        "the adapters did not change any output: nothing was compared"
    set_adapters(policy, language=0.5, vision=2.0, seed=1)  # the language adapters as before: only vision moves
    second = sync_and_check(policy, engine, merged_hf, requests, sync, path)
    assert any(a.response_ids != b.response_ids for a, b in zip(first, second)), \
        "the vision adapters changed no output for images the engine had seen: stale vision embeddings?"


@pytest.fixture(scope="module")
def base_greedy(hf, requests):
    return hf.generate(requests, GREEDY)


@contextlib.contextmanager
def given_back(engine, hf, requests, base_greedy):
    """A shared engine (tests/rollout/conftest.py) put back as it was after the test: the base model's weights (the
    HF reference's) and its own sync bucket size; it then gives the base model's greedy outputs again."""
    bucket_mb = engine.rollout.sync_bucket_mb
    try:
        yield engine
    finally:
        engine.rollout.sync_bucket_mb = bucket_mb
        engine.update_weights(clone_state(hf.model).items())
    assert_equal_to_hf(engine.generate(requests, GREEDY), base_greedy, f"{engine.name} given back")


@pytest.mark.vllm
def test_vllm_serves_the_adapter_itself_path_b(tiny_model_path, policy, base_greedy, merged_hf, requests):
    from vlmrl.rollout.registry import get_backend

    with get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     lora_rank=RANK, lora_vision=True) as engine:
        assert engine.serves_adapters()
        check_engine(policy, engine, base_greedy, merged_hf, requests, sync="auto", path="adapter")
        assert policy.last_sync_bytes == sum(p.numel() * 4 for p in policy.trainable), "adapter file = adapters"


@pytest.mark.vllm
def test_vllm_takes_merged_weights_path_a(vllm_qwen2_5_vl, hf, policy, base_greedy, merged_hf, requests):
    with given_back(vllm_qwen2_5_vl, hf, requests, base_greedy) as engine:
        assert not engine.serves_adapters() and not engine.accepts_partial_weights
        check_engine(policy, engine, base_greedy, merged_hf, requests, sync="auto", path="merged")
        full = sum(t.numel() * t.element_size() for t in policy.full_model().state_dict().values())
        assert policy.last_sync_bytes == full, "vLLM reloads whole layers: every weight is sent"


@pytest.mark.sglang
def test_sglang_takes_merged_adapted_layers_only_path_a(sglang_qwen2_5_vl, hf, policy, base_greedy, merged_hf,
                                                        requests):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # the engines reconfigure logging; a handler on the logger itself sees it all
    lora_logger = logging.getLogger("vlmrl.actor.lora")
    with given_back(sglang_qwen2_5_vl, hf, requests, base_greedy) as engine:
        assert not engine.serves_adapters() and engine.accepts_partial_weights
        lora_logger.addHandler(handler)
        level, lora_logger.level = lora_logger.level, logging.WARNING  # SGLang's log_level=error lowers the root's
        try:
            check_engine(policy, engine, base_greedy, merged_hf, requests, sync="auto", path="merged")
        finally:
            lora_logger.removeHandler(handler)
            lora_logger.setLevel(level)
        fallbacks = [r.getMessage() for r in records if "syncing merged weights" in r.getMessage()]
        assert len(fallbacks) == 1 and fallbacks[0].startswith("sglang:"), fallbacks
        from peft.tuners.lora import LoraLayer

        adapted = sum(m.base_layer.weight.numel() * 4 for m in policy.model.modules() if isinstance(m, LoraLayer))
        assert policy.last_sync_bytes == adapted, "a partial update sends the adapted layers' weights only"


@pytest.mark.sglang
def test_sglang_server_takes_merged_weights_path_a(sglang_server_qwen2_5_vl, hf, policy, base_greedy, merged_hf,
                                                   requests):
    """The HTTP server cannot serve adapters from vlmrl (no adapter upload on CPU), so `auto` merges; its multimodal
    embedding cache stays ON, so the vision-only sync must still reach images the server has already encoded."""
    with given_back(sglang_server_qwen2_5_vl, hf, requests, base_greedy) as engine:
        assert engine.rollout.sglang.vlm_cache_size_mb == 100
        assert not engine.serves_adapters()
        check_engine(policy, engine, base_greedy, merged_hf, requests, sync="auto", path="merged")


@pytest.mark.vllm
def test_an_adapter_on_the_output_head_goes_to_a_lora_serving_vllm_as_merged_weights(tiny_model_path, requests):
    """The CPU demo's LoRA adapts lm_head (docs/lora.md); vLLM's LoRA serving refuses an adapter on it, so `auto`
    on an engine started with enable_lora must sync merged weights (== HF merged), and `adapter` must say why."""
    from vlmrl.rollout.registry import get_backend

    config = ActorConfig(model_path=tiny_model_path, device="cpu",
                         lora=LoraConfig(rank=RANK, alpha=16, target_modules=["q_proj", "down_proj", "lm_head"]))
    head = Actor(config, total_steps=1, mini_batch_samples=1)
    set_adapters(head, language=0.5, vision=0.0, seed=2)
    # a fresh transformers reference: the module's `merged_hf` holds the other policy's adapted layers, and a partial
    # update sends only this policy's
    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as merged_hf, \
            get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                        lora_rank=RANK) as engine:
        assert engine.serves_adapters()
        head.lora_sync.lora.sync = "adapter"
        with pytest.raises(ValueError, match="lm_head"):
            head.lora_sync.path(engine)
        sync_and_check(head, engine, merged_hf, requests, sync="auto", path="merged")


@pytest.mark.vllm
def test_with_lora_vision_off_vllm_serves_what_the_trainer_trains(tiny_model_path, requests):
    """Qwen2.5-VL's vision MLP is named like the language model's: with lora.vision=off and an exclude_modules
    narrower than the default, the adapter must still reach only layers the engine started for vision=off (no
    tower/connector LoRA) serves, so its greedy output equals HF merged's. A policy that does hold vision adapters
    is refused as an adapter by such an engine and goes to it as merged weights under `auto`."""
    from vlmrl.rollout.config import RolloutConfig
    from vlmrl.rollout.registry import backend_options, get_backend

    lora = LoraConfig(rank=RANK, alpha=16, exclude_modules=r".*language_model\.layers\.0\..*")
    narrow = Actor(ActorConfig(model_path=tiny_model_path, device="cpu", lora=lora), total_steps=1,
                   mini_batch_samples=1)
    set_adapters(narrow, language=0.5, vision=2.0, seed=3)
    tower = Actor(ActorConfig(model_path=tiny_model_path, device="cpu",
                              lora=LoraConfig(rank=RANK, alpha=16, vision="tower")), total_steps=1,
                  mini_batch_samples=1)
    tower.lora_sync.lora.vision = "off"  # what the engine below was started for
    # a fresh transformers reference: the module's `merged_hf` holds other policies' adapted layers
    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as merged_hf, \
            get_backend("vllm", tiny_model_path, backend_options(  # started as the run would start it
                RolloutConfig(dtype="float32", timeout_s=300), "vllm", max_model_len=1024, seed=0, lora=lora)) as engine:
        assert engine.serves_adapters()
        sync_and_check(narrow, engine, merged_hf, requests, sync="auto", path="adapter")
        tower.lora_sync.lora.sync = "adapter"
        with pytest.raises(ValueError, match="vision-side adapters .* actor.lora.vision=off"):
            tower.lora_sync.path(engine)
        tower.lora_sync.lora.sync = "auto"
        assert tower.lora_sync.path(engine) == "merged"
