"""LoRA runs of the fit loop on the tiny model: a checkpoint holds the PEFT adapter beside a merged HF folder that
vLLM and SGLang load as it is (and vLLM serves the adapter on the base model to the same outputs); a run killed with
SIGKILL after a checkpoint resumes bit-exactly (adapters and their optimizer state restored); the CPU demo's LoRA
settings learn the synthetic task (slow)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from safetensors import safe_open

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, build_batch, greedy_mismatch
from tests.trainer.test_fit import ROOT, RisenBy, _straight_and_killed_then_resumed, base_args
from vlmrl.actor.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS
from vlmrl.config import load_config
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.vision=tower", "actor.optim.lr=1e-2",
        # the random-init model earns no reward, so no GRPO gradient: the format warm-up (which trains what the
        # actor trains: the adapters) moves them off B = 0, and the KL term then has something to pull on
        "trainer.format_warmup_steps=3", "trainer.format_warmup_batch_size=4", "trainer.format_warmup_lr=5e-2"]


def _greedy(name: str, model_path: str, requests, adapter=None) -> list:
    """Greedy outputs of backend `name` on `model_path`; `adapter`: vLLM serving that adapter folder on it."""
    from vlmrl.rollout.registry import get_backend

    options = {"lora_rank": 8, "lora_vision": True} if adapter else {}
    with get_backend(name, model_path, dtype="float32", max_model_len=1024, timeout_s=300, **options) as backend:
        if adapter:
            backend.update_adapter(str(adapter))
        return backend.generate(requests, GREEDY)


@pytest.mark.vllm
@pytest.mark.sglang
def test_lora_checkpoint_is_a_merged_model_vllm_and_sglang_load_plus_the_adapter(tiny_model_path, tmp_path):
    out = tmp_path / "lora"
    fit(load_config(base_args(tiny_model_path, out, *LORA, "rollout.name=vllm", "trainer.total_steps=2",
                              "trainer.save_freq=2", "trainer.val_before_train=false", "actor.use_kl_loss=true",
                              "actor.kl_loss_coef=0.01")))
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]  # step 0: the warm-up's line
    assert rows[1]["rollout/logprob_abs_diff"] < 1e-3, "the engine's adapter is not the trainer's policy"
    assert rows[1]["actor/kl_loss"] > 0  # the KL reference: the adapters-off model, away from the policy
    checkpoint = out / "checkpoints" / "global_step_2"
    adapter = checkpoint / ADAPTER_DIR
    assert (adapter / ADAPTER_WEIGHTS).is_file()
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["r"] == 8
    with safe_open(str(adapter / ADAPTER_WEIGHTS), "pt") as weights:
        assert any(".visual.blocks." in name for name in weights.keys())  # lora.vision=tower
    assert (checkpoint / "model.safetensors").is_file()

    from vlmrl.processors.loading import load_processor

    requests = build_batch(load_processor(str(checkpoint)))
    expected = _greedy("hf", str(checkpoint), requests)  # transformers on the merged folder
    base = _greedy("hf", tiny_model_path, requests)
    moved = max((abs(x - y) for a, b in zip(expected, base) if a.response_ids == b.response_ids
                for x, y in zip(a.response_logprobs, b.response_logprobs)), default=0.0)
    assert moved > 10 * LOGPROB_TOL or any(a.response_ids != b.response_ids for a, b in zip(expected, base)), \
        "training changed nothing the engines could be checked on"
    runs = {"vllm": _greedy("vllm", str(checkpoint), requests), "sglang": _greedy("sglang", str(checkpoint), requests),
            "vllm + adapter on the base": _greedy("vllm", tiny_model_path, requests, adapter=adapter)}
    problems = [message for name, results in runs.items() for ref, got in zip(expected, results)
                if (message := greedy_mismatch(ref, got, name))]
    assert not problems, "\n".join(problems)
    for name, results in runs.items():  # the trained weights themselves, not only the same argmax
        worst = max(abs(x - y) for ref, got in zip(expected, results)
                    for x, y in zip(ref.response_logprobs, got.response_logprobs))
        assert worst <= LOGPROB_TOL, f"{name}: logprobs differ from HF on the checkpoint by {worst:.2e}"


# A variant (marker `full`, make test-all): the kill -9 resume matrix on LoRA. make test keeps one kill -9 run
# (tests/trainer/test_fit.py::test_dynamic_sampling_trains_only_groups_with_signal_and_resumes_bit_exactly_after_kill_9:
# a killed run resumes bit-exactly), and the adapter folder's round trip (tests/actor/test_lora.py); this one adds
# that the two meet (adapters and their optimizer state come back from a checkpoint).
@pytest.mark.slow
@pytest.mark.full
def test_lora_run_killed_after_a_checkpoint_resumes_bit_exactly(tiny_model_path, tmp_path):
    common = [*LORA, "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "trainer.total_steps=5",
              "trainer.save_freq=2", "trainer.test_freq=5", "trainer.val_before_train=false"]
    expected, got = _straight_and_killed_then_resumed(tiny_model_path, tmp_path, *common)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 5]
    assert got == expected
    assert all(r["actor/kl_loss"] > 0 for r in got[1:]), "the adapters never left the base: nothing was resumed"
    assert (tmp_path / "killed" / "checkpoints" / "global_step_4" / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()


# Both seeds are variants (marker `full`, make test-all): the LoRA demo's learning runs (seed 1 learns within 100
# steps, 51 s on 2 cores; seed 2 is the one on which rank 64 collapsed, so it guards the choice of rank 16, README
# "LoRA", and needs all 150 demo steps). make test keeps the image demo's full fine-tuning learning run, LoRA's
# update, reference and sync on every engine (tests/actor/test_lora.py, tests/rollout/test_lora_sync.py) and the
# LoRA checkpoint that vLLM and SGLang load (above).
@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize(("seed", "steps"), [(1, 100), (2, 150)])
def test_the_demos_lora_settings_learn_the_synthetic_task(tmp_path, seed, steps):
    """`RECIPE=lora examples/qwen2_5_vl_grpo.sh`: the demo's config with examples/configs/tiny_synthetic_lora.yaml
    (rank 16 adapters on the language model and lm_head, lr 1e-3): validation accuracy rises >= 0.3 above its step-0
    value (chance, after the random-label warm-up) within the demo's budget. Two seeds: seed 2 is the one on which
    rank 64 collapsed onto one colour and never learned (docs/lora.md). Measured on vLLM: seed 1 0.25 -> 0.71 at 80,
    0.73 at 100; seed 2 0.27 -> 0.48 at 100, 0.60 at 110, 0.69 at 140 (seed 3, not run here for time: 0.27 -> 0.58 at
    100). Each seed is a full demo run (~2-3 min on 2 cores)."""
    backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    out = tmp_path / "demo_lora"
    fit(load_config([f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}",
                     f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic_lora.yaml'}", f"rollout.name={backend}",
                     f"trainer.seed={seed}", f"trainer.total_steps={steps}", f"trainer.save_freq={steps}",
                     f"trainer.output_dir={out}"]), stop=RisenBy(0.3))
    rows = read_metrics(out / "metrics.jsonl")
    curve = [(row["step"], row["val/accuracy"]) for row in rows if "val/accuracy" in row]
    start = curve[0][1]
    assert start <= 0.45, f"after the random-label warm-up accuracy should be near chance (0.25): {curve}"
    assert max(acc for _, acc in curve) >= start + 0.3, f"LoRA seed {seed}: accuracy did not rise by 0.3: {curve}"
    assert (out / "checkpoints" / "latest" / "adapter").is_dir()  # it was a LoRA run
