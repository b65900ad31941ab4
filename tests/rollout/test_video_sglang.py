"""SGLang's Engine with videos (fp32) against the HF reference. SGLang reads frames as 24 fps whatever the video's
timing (measured; see vlmrl.rollout.sglang): videos sampled at 24 fps give the same tokens as HF, and a video at 2 fps
is refused before the engine instead of being read with other position ids."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, assert_logprobs_match_hf, greedy_mismatch
from tests.rollout.video_helpers import video_batch
from vlmrl.rollout.base import InvalidRequestError
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.sglang

VIDEO_LOGPROB_TOL = 5e-4
"""fp32 summation-order noise over a prompt of ~150 video tokens (measured up to 1.8e-4 against HF; images: 1e-4)."""


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    from vlmrl.rollout import get_backend

    with get_backend("sglang", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as started:
        yield started


def test_video_greedy_equals_hf_fp32(backend, hf, tiny_model_path):
    """7 video requests at 24 fps (one also holding an image): HF's ids token for token, close raw logprobs."""
    requests = video_batch(tiny_model_path, 24.0)
    ref, got = hf.generate(requests, GREEDY), backend.generate(requests, GREEDY)
    problems = [m for a, b in zip(ref, got) if (m := greedy_mismatch(a, b, "sglang"))]
    assert not problems, "\n".join(problems)
    for a, b in zip(ref, got):
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < VIDEO_LOGPROB_TOL


def test_video_n4_logprobs_match_hf_teacher_forced(backend, hf, tiny_model_path):
    requests = video_batch(tiny_model_path, 24.0)[:3]
    results = backend.generate(requests, SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=1))
    assert len(results) == 12
    assert_logprobs_match_hf(hf, requests, results, 4, VIDEO_LOGPROB_TOL, "sglang")


def test_a_video_whose_fps_sglang_would_misread_is_refused(backend, tiny_model_path):
    request = video_batch(tiny_model_path, 2.0)[0]
    with pytest.raises(InvalidRequestError, match="SGLang reads frames as 24 fps"):
        backend.generate([request], GREEDY)
