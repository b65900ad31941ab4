"""Video requests for the engine tests and the contract every engine's video path is tested against
(`VideoContract`, subclassed once per engine module and run on each embedded family: Qwen2.5-VL's timing is
second_per_grid_ts in the position ids, Qwen3-VL's the `<x.x seconds>` text before each temporal patch)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, assert_logprobs_match_hf, greedy_mismatch, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.data.synthetic import generate_rows
from vlmrl.processors.loading import load_processor
from vlmrl.types import RolloutRequest, SamplingParams


def video_batch(model_path: str, fps: float) -> list[RolloutRequest]:
    """Six one-video requests and one with an image and a video; frames taken at `fps`."""
    processor = load_processor(model_path, DataConfig(video_fps=fps, max_prompt_length=1024))
    rows = generate_rows("motion", 6, seed=3, split="val")
    mixed = dict(rows[0], prompt=[{"role": "user", "content": "<image>Look, then <video>: which way?"}],
                 # another image per fps: SGLang keys its prefix cache of a request holding an image and a video on
                 # their pixels alone (vlmrl.rollout.sglang), so the same pixels at another fps would hit it
                 images=[noise_image(84, 56, seed=int(fps))])
    requests = [processor.build_request(row, i) for i, row in enumerate([*rows, mixed])]
    assert [len(r.videos) for r in requests] == [1] * 7 and len(requests[-1].images) == 1
    return requests


class VideoContract:
    """What every engine must show with videos, on each family: one canonical request (sampled frames + their
    timing) gives HF's greedy tokens and raw logprobs, at the video's own sampled fps. A subclass provides the
    module's `backend` fixture (started on `video_model_path`, tests/rollout/conftest.py) and its `tolerance`."""

    tolerance: float

    @pytest.mark.parametrize("fps", [2.0, 24.0])
    def test_video_greedy_equals_hf_fp32(self, backend, video_hf, video_model_path, fps):
        """7 video requests (one also holding an image): HF's ids token for token, close raw logprobs."""
        requests = video_batch(video_model_path, fps)
        ref, got = video_hf.generate(requests, GREEDY), backend.generate(requests, GREEDY)
        problems = [m for a, b in zip(ref, got) if (m := greedy_mismatch(a, b, backend.name))]
        assert not problems, "\n".join(problems)
        for a, b in zip(ref, got):
            assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < self.tolerance

    def test_video_n4_logprobs_match_hf_teacher_forced(self, backend, video_hf, video_model_path):
        requests = video_batch(video_model_path, 2.0)[:3]
        results = backend.generate(requests, SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=1))
        assert len(results) == 12
        assert_logprobs_match_hf(video_hf, requests, results, 4, self.tolerance, backend.name)

    def test_the_fps_reaches_the_engine(self, backend, video_model_path):
        """The same frames at 2 and 24 fps are different inputs (Qwen2.5-VL: other temporal position ids; Qwen3-VL:
        other timestamps in the text): the engine's logprobs differ, so it did not assume a rate of its own."""
        slow, fast = video_batch(video_model_path, 2.0)[0], video_batch(video_model_path, 24.0)[0]
        assert (slow.videos[0].frames == fast.videos[0].frames).all()
        one = SamplingParams(temperature=0.0, max_new_tokens=1, top_logprobs=3)
        a, b = backend.generate([slow], one)[0], backend.generate([fast], one)[0]
        assert abs(a.response_logprobs[0] - b.response_logprobs[0]) > 1e-4
