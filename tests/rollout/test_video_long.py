"""Long videos (the last temporal position past max(h, w), which vlmrl refused while it followed transformers 5.19's
rule): the hf backend, vLLM, SGLang and the trainer all place the text after the video at its largest position + 1,
so their greedy outputs and logprobs agree (fp32, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_mismatch, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.processors.loading import load_processor
from vlmrl.types import RolloutRequest


def _frames(count: int, seed: int) -> list[Image.Image]:
    """`count` 112x112 frames (4x4 merged patches): a bright square moving right over noise."""
    rng = np.random.default_rng(seed)
    frames = []
    for k in range(count):
        pixels = rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)
        pixels[40:72, 4 + 6 * k: 36 + 6 * k] = 255
        frames.append(Image.fromarray(pixels, "RGB"))
    return frames


def long_requests(model_path: str) -> list[RolloutRequest]:
    """Five requests whose videos reach past max(h, w) = 4: 16 frames at 2 fps (last temporal position 14), 12 at
    1 fps (20), one after an image, one next to a short video, one followed by more text."""
    def build(fps: float, content: str, videos: list, images: list, index: int) -> RolloutRequest:
        processor = load_processor(model_path, DataConfig(video_fps=fps, max_prompt_length=1024))
        row = {"prompt": [{"role": "user", "content": content}], "videos": videos, "images": images}
        return processor.build_request(row, index)

    return [
        build(2.0, "<video>Which way does the square move?", [_frames(16, 1)], [], 0),
        build(1.0, "<video>Which way?", [_frames(12, 2)], [], 1),
        build(2.0, "<image>Look, then <video>: which way?", [_frames(16, 3)], [noise_image(84, 56, seed=3)], 2),
        build(2.0, "<video> and <video>: the same way?", [_frames(4, 4), _frames(14, 5)], [], 3),
        build(2.0, "<video>Describe the video in one sentence, then say which way the square moves and how fast.",
              [_frames(10, 6)], [], 4),
    ]


def _two_video_backend(name: str, model_path: str):
    """`name` started in fp32, taking two videos a request (the shared fixtures take one)."""
    from vlmrl.rollout.registry import get_backend

    return get_backend(name, model_path, dtype="float32", max_model_len=1024, limit_videos=2, timeout_s=300)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    """The HF reference taking two videos a request."""
    with _two_video_backend("hf", tiny_model_path) as backend:
        yield backend


@pytest.fixture(scope="module")
def requests(tiny_model_path):
    return long_requests(tiny_model_path)


@pytest.fixture(scope="module")
def hf_greedy(hf, requests):
    return hf.generate(requests, GREEDY)


def test_the_videos_are_long(hf, requests):
    """transformers 5.19's own get_rope_index places the text after each of these videos elsewhere (what the hf
    backend, given vlmrl's rule, must not do), so every test below would fail under the old rule."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    for request in requests:
        inputs = hf.model_inputs(request)
        args = dict(mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
                    video_grid_thw=inputs["video_grid_thw"], second_per_grid_ts=inputs["second_per_grid_ts"],
                    attention_mask=inputs["attention_mask"])
        transformers_own, _ = Qwen2_5_VLModel.get_rope_index(hf.model.model, inputs["input_ids"], **args)
        assert not torch.equal(transformers_own, hf.processor.prompt_inputs(request).position_ids[:, None]), \
            request.uid


def test_hf_uses_vlmrls_positions_and_its_decode_steps_continue_them(hf, requests, hf_greedy):
    """The hf model's get_rope_index gives the trainer's ids (vlmrl's) with transformers' rope deltas, and generate's
    per-step logprobs (prefill, then decode steps placed by those deltas) equal one teacher-forced forward."""
    for request, result in zip(requests, hf_greedy):
        inputs = hf.model_inputs(request)
        positions, deltas = hf.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs["video_grid_thw"], second_per_grid_ts=inputs["second_per_grid_ts"],
            attention_mask=inputs["attention_mask"])
        expected = hf.processor.prompt_inputs(request).position_ids
        assert torch.equal(positions[:, 0], expected), request.uid
        assert deltas.tolist() == [[int(expected.max()) + 1 - expected.shape[1]]]
        scored = hf.score([request], [result.response_ids])[0]
        assert max(abs(a - b) for a, b in zip(scored, result.response_logprobs)) < 1e-4, request.uid


@pytest.fixture(scope="module")
def vllm(tiny_model_path):
    with _two_video_backend("vllm", tiny_model_path) as started:
        yield started


@pytest.fixture(scope="module")
def sglang(tiny_model_path):
    with _two_video_backend("sglang", tiny_model_path) as started:
        yield started


def _assert_greedy_equal(ref, got, name: str, tol: float) -> None:
    problems = [m for a, b in zip(ref, got) if (m := greedy_mismatch(a, b, name))]
    assert not problems, "\n".join(problems)
    for a, b in zip(ref, got):
        worst = max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs))
        assert worst < tol, f"{name} request {a.uid}: logprobs differ from hf by {worst:.2e}"


@pytest.mark.vllm
def test_vllm_greedy_equals_hf_on_long_videos(vllm, requests, hf_greedy):
    _assert_greedy_equal(hf_greedy, vllm.generate(requests, GREEDY), "vllm", LOGPROB_TOL)


@pytest.mark.sglang
def test_sglang_greedy_equals_hf_on_long_videos(sglang, requests, hf_greedy):
    _assert_greedy_equal(hf_greedy, sglang.generate(requests, GREEDY), "sglang", LOGPROB_TOL)


@pytest.mark.vllm
def test_trainer_logprobs_equal_vllms_on_long_videos(vllm, requests, tiny_model_path):
    """The trainer's teacher-forced logprobs (the actor's forward with vlmrl's explicit position ids, padded into one
    batch) on vLLM's sampled responses equal the logprobs vLLM returned."""
    from vlmrl.actor.local import Actor
    from vlmrl.batch.padding import pad_results, stack_samples
    from vlmrl.config import ActorConfig, OptimConfig
    from vlmrl.types import SamplingParams

    processor = load_processor(tiny_model_path, DataConfig(max_prompt_length=1024))
    results = vllm.generate(requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    prompts = [processor.prompt_inputs(r) for r in requests]
    samples = pad_results(prompts, results, prompt_length=max(len(p.input_ids) for p in prompts), response_length=8,
                          pad_token_id=processor.pad_token_id, policy_version=0)
    batch = stack_samples(samples)
    config = ActorConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=4,
                         device="cpu", dtype="float32")
    logprobs, _ = Actor(config, total_steps=1, mini_batch_samples=len(batch)).compute_logprobs(batch)
    gap = ((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).max()
    assert float(gap) < LOGPROB_TOL, f"trainer vs vllm logprobs differ by {float(gap):.2e}"
