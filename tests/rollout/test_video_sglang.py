"""SGLang's Engine with videos (fp32) against the HF reference: the request's processor outputs with their timing
(SGLang would read bare frames as 24 fps; see vlmrl.rollout.sglang) give HF's tokens and raw logprobs at the
video's own sampling rate."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, assert_logprobs_match_hf, greedy_mismatch
from tests.rollout.video_helpers import video_batch
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.sglang

VIDEO_LOGPROB_TOL = 5e-4
"""fp32 summation-order noise over a prompt of ~150 video tokens (measured up to 1.8e-4 against HF; images: 1e-4)."""


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    from vlmrl.rollout import get_backend

    with get_backend("sglang", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as started:
        yield started


@pytest.mark.parametrize("fps", [2.0, 24.0])
def test_video_greedy_equals_hf_fp32(backend, hf, tiny_model_path, fps):
    """7 video requests (one also holding an image): HF's ids token for token, close raw logprobs."""
    requests = video_batch(tiny_model_path, fps)
    ref, got = hf.generate(requests, GREEDY), backend.generate(requests, GREEDY)
    problems = [m for a, b in zip(ref, got) if (m := greedy_mismatch(a, b, "sglang"))]
    assert not problems, "\n".join(problems)
    for a, b in zip(ref, got):
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < VIDEO_LOGPROB_TOL


def test_video_n4_logprobs_match_hf_teacher_forced(backend, hf, tiny_model_path):
    requests = video_batch(tiny_model_path, 2.0)[:3]
    results = backend.generate(requests, SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=1))
    assert len(results) == 12
    assert_logprobs_match_hf(hf, requests, results, 4, VIDEO_LOGPROB_TOL, "sglang")


def test_the_fps_reaches_the_engine(backend, tiny_model_path):
    """The same frames at 2 and 24 fps are different inputs (other temporal position ids): SGLang's logprobs differ,
    so it did not read the video at a rate of its own."""
    slow, fast = video_batch(tiny_model_path, 2.0)[0], video_batch(tiny_model_path, 24.0)[0]
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    a, b = backend.generate([slow], one)[0], backend.generate([fast], one)[0]
    assert abs(a.response_logprobs[0] - b.response_logprobs[0]) > 1e-4


def test_the_server_refuses_video_before_any_http_call(tiny_model_path):
    """Over HTTP the processor outputs do not travel and the server has no video decoder here: a clear refusal
    naming the way out, not a server-side crash."""
    from types import SimpleNamespace

    from vlmrl.rollout.base import InvalidRequestError
    from vlmrl.rollout.sglang import SGLangServerBackend

    request = video_batch(tiny_model_path, 2.0)[0]
    with pytest.raises(InvalidRequestError, match="sglang-server: .* holds 1 video.*use the sglang \\(Engine\\)"):
        SGLangServerBackend.video_entry(SimpleNamespace(name="sglang-server"), request)
