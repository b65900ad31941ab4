"""SGLang's Engine with videos (fp32) against the HF reference, on Qwen2.5-VL and Qwen3-VL: the request's processor
outputs with their timing (SGLang would read bare frames as 24 fps; see vlmrl.rollout.sglang) give HF's tokens and
raw logprobs at the video's own sampling rate (the video contract, `tests.rollout.video_helpers.VideoContract`)."""

from __future__ import annotations

import pytest

from tests.rollout.video_helpers import VideoContract, video_batch

pytestmark = pytest.mark.sglang

VIDEO_LOGPROB_TOL = 5e-4
"""fp32 summation-order noise over a prompt of ~150 video tokens (measured up to 1.8e-4 against HF; images: 1e-4)."""


@pytest.fixture(scope="module")
def backend(video_sglang):
    return video_sglang


class TestSGLangVideo(VideoContract):
    tolerance = VIDEO_LOGPROB_TOL


def test_the_server_refuses_video_before_any_http_call(tiny_model_path):
    """Over HTTP the processor outputs do not travel and the server has no video decoder here: a clear refusal
    naming the way out, not a server-side crash."""
    from types import SimpleNamespace

    from vlmrl.rollout.errors import InvalidRequestError
    from vlmrl.rollout.sglang_server import SGLangServerBackend

    request = video_batch(tiny_model_path, 2.0)[0]
    with pytest.raises(InvalidRequestError, match="sglang-server: .* holds 1 video.*use the sglang \\(Engine\\)"):
        SGLangServerBackend.video_entry(SimpleNamespace(name="sglang-server"), request)
