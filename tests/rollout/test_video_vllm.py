"""vLLM with videos (fp32, in-process) against the HF reference, on Qwen2.5-VL and Qwen3-VL: one canonical request
(sampled frames + their metadata, do_sample_frames off) gives the same greedy tokens and the same raw logprobs, at
the video's own sampled fps (the video contract, `tests.rollout.video_helpers.VideoContract`)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import LOGPROB_TOL
from tests.rollout.video_helpers import VideoContract

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(video_vllm):
    return video_vllm


class TestVLLMVideo(VideoContract):
    tolerance = LOGPROB_TOL
