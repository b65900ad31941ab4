"""vLLM with videos (fp32, in-process) against the HF reference, on Qwen2.5-VL and Qwen3-VL: one canonical request
(sampled frames + their metadata, do_sample_frames off) gives the same greedy tokens and the same raw logprobs, at
the video's own sampled fps (the video contract, `tests.rollout.video_helpers.VideoContract`)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import LOGPROB_TOL
from tests.rollout.video_helpers import VideoContract

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(video_model_path):
    from vlmrl.rollout import get_backend

    with get_backend("vllm", video_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as started:
        yield started


class TestVLLMVideo(VideoContract):
    tolerance = LOGPROB_TOL
