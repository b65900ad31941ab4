"""Video requests for the engine tests: the synthetic motion task's rows (one video each) and one row mixing an image
and a video, built by vlmrl.processors at a given sampling rate."""

from __future__ import annotations

from tests.rollout.helpers import noise_image
from vlmrl.data.synthetic import generate_rows
from vlmrl.processors import load_processor
from vlmrl.processors.config import ProcessorConfig
from vlmrl.types import RolloutRequest


def video_batch(model_path: str, fps: float) -> list[RolloutRequest]:
    """Six one-video requests and one with an image and a video; frames taken at `fps`."""
    processor = load_processor(model_path, ProcessorConfig(video_fps=fps, max_prompt_length=1024))
    rows = generate_rows("motion", 6, seed=3, split="val")
    mixed = dict(rows[0], prompt=[{"role": "user", "content": "<image>Look, then <video>: which way?"}],
                 # another image per fps: SGLang keys its prefix cache of a request holding an image and a video on
                 # their pixels alone (vlmrl.rollout.sglang), so the same pixels at another fps would hit it
                 images=[noise_image(84, 56, seed=int(fps))])
    requests = [processor.build_request(row, i) for i, row in enumerate([*rows, mixed])]
    assert [len(r.videos) for r in requests] == [1] * 7 and len(requests[-1].images) == 1
    return requests
