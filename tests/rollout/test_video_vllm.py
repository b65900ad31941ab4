"""vLLM with videos (fp32, in-process) against the HF reference: one canonical request (sampled frames + timing)
gives the same greedy tokens and the same raw logprobs, at the video's own sampled fps."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, assert_logprobs_match_hf, greedy_mismatch
from tests.rollout.video_helpers import video_batch
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    from vlmrl.rollout import get_backend

    with get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as started:
        yield started


@pytest.mark.parametrize("fps", [2.0, 24.0])
def test_video_greedy_equals_hf_fp32(backend, hf, tiny_model_path, fps):
    """7 video requests (one also holding an image): the same ids as HF token for token, close raw logprobs."""
    requests = video_batch(tiny_model_path, fps)
    ref, got = hf.generate(requests, GREEDY), backend.generate(requests, GREEDY)
    problems = [m for a, b in zip(ref, got) if (m := greedy_mismatch(a, b, "vllm"))]
    assert not problems, "\n".join(problems)
    for a, b in zip(ref, got):
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < LOGPROB_TOL


def test_video_n4_logprobs_match_hf_teacher_forced(backend, hf, tiny_model_path):
    requests = video_batch(tiny_model_path, 2.0)[:3]
    results = backend.generate(requests, SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=1))
    assert len(results) == 12
    assert_logprobs_match_hf(hf, requests, results, 4, LOGPROB_TOL, "vllm")


def test_the_fps_reaches_the_engine(backend, tiny_model_path):
    """The same frames at 2 and 24 fps are different inputs (other temporal position ids): the engine's logprobs
    differ, so it did not assume a rate of its own."""
    slow, fast = video_batch(tiny_model_path, 2.0)[0], video_batch(tiny_model_path, 24.0)[0]
    assert (slow.videos[0].frames == fast.videos[0].frames).all()
    one = SamplingParams(temperature=0.0, max_new_tokens=1, top_logprobs=3)
    a, b = backend.generate([slow], one)[0], backend.generate([fast], one)[0]
    assert abs(a.response_logprobs[0] - b.response_logprobs[0]) > 1e-4
