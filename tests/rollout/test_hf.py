"""The HF reference backend: the engine contract (against a second HF instance), its scoring, seeds and RNG care."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.rollout.helpers import GREEDY, EngineContract
from vlmrl.types import SamplingParams


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024) as started:
        yield started


class TestHFBackend(EngineContract):
    pass


def test_greedy_logprobs_equal_teacher_forced_score(hf, batch, hf_greedy):
    """generate's per-step raw logprobs and one teacher-forced forward agree: both see the same positions/images."""
    for request, result in zip(batch, hf_greedy):
        scored = hf.score([request], [result.response_ids])[0]
        assert max(abs(a - b) for a, b in zip(scored, result.response_logprobs)) < 1e-4


def test_top_logprobs_rank_the_greedy_choice_and_leave_out_banned(hf_greedy, batch):
    for request, result in zip(batch, hf_greedy):
        for token, top in zip(result.response_ids, result.top_logprobs):
            assert next(iter(top)) == token
            assert len(top) == 5 and not set(top) & set(request.banned_token_ids)


def test_seeded_sampling_reproducible_without_touching_global_rng(hf, batch):
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=5)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = [r.response_ids for r in hf.generate(batch[:3], sampling)]
    assert torch.equal(torch.get_rng_state(), state), "a seeded generate moved the caller's RNG"
    assert first == [r.response_ids for r in hf.generate(batch[:3], sampling)]
    assert len({tuple(ids) for ids in first}) > 1


def test_sleep_and_wake_up_log_once_on_cpu(hf, batch, hf_greedy, caplog):
    with caplog.at_level(logging.WARNING, logger="vlmrl.rollout.base"):
        for _ in range(2):
            hf.sleep()
            hf.wake_up()
    assert sum("sleep() is not supported" in r.message for r in caplog.records) <= 1
    assert hf.generate(batch[:1], GREEDY)[0].response_ids == hf_greedy[0].response_ids


def test_sampling_settings_of_the_model_folder_are_not_inherited(tiny_model_path, batch, hf_greedy, tmp_path):
    """A model's generation_config.json (Qwen2.5-Instruct ships repetition_penalty=1.05) must not change what the
    reference samples: the engines use only the settings vlmrl passes."""
    import json
    import shutil

    from vlmrl.rollout.registry import get_backend

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(repetition_penalty=1.5, no_repeat_ngram_size=2, top_k=1, temperature=0.01, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    with get_backend("hf", str(folder), dtype="float32", max_model_len=1024) as penalised:
        got = penalised.generate(batch, GREEDY)
    assert [r.response_ids for r in got] == [r.response_ids for r in hf_greedy]
    assert any(len(set(r.response_ids)) < len(r.response_ids) for r in got), "no repeated token: nothing tested"


def test_a_run_backend_starts_from_its_rollout_section(tiny_model_path):
    from vlmrl.config import RolloutConfig
    from vlmrl.rollout.config import HFConfig
    from vlmrl.rollout.registry import start_backend

    section = RolloutConfig(name="vllm", dtype="float32", timeout_s=90.0, start_timeout_s=120.0, limit_images=3,
                            hf=HFConfig(device="cpu", engine_kwargs={"attn_implementation": "eager"}))
    with start_backend(section, tiny_model_path, max_model_len=512, seed=7, name="hf") as started:
        options, r = started.options, started.rollout
        assert started.name == "hf", "`name` picks the backend over rollout.name"
        assert (options.resolved_dtype(), options.max_model_len, options.seed, r.limit_images) == ("float32", 512, 7, 3)
        assert (r.timeout_s, r.start_timeout_s) == (90.0, 120.0)
        assert started.device.type == "cpu" and started.model.dtype == torch.float32
        assert started.model.config._attn_implementation == "eager", "rollout.hf.engine_kwargs reach from_pretrained"
