"""What the judge is shown (reward.judge): the template rendered with a row and a response, and the row's images and
video frames as PNG data URLs (lossless: the judge sees the pixels the policy saw), with what identifies each in the
judge's cache keys (its hash, never its pixels). Used by vlmrl.rewards.judge."""

from __future__ import annotations

import base64
import hashlib
import io
from typing import TYPE_CHECKING, Any

from vlmrl.rewards.config import JudgeConfig

if TYPE_CHECKING:
    from vlmrl.types import RolloutRequest


def render_text(template: str, request: RolloutRequest, response: str, question_key: str) -> str:
    """The template filled with a row and a response (reward.judge.template's fields)."""
    info = dict(request.extra_info)
    if "{question" in template and question_key not in info:
        raise ValueError(f"the judge template shows {{question}}, read from extra_info[{question_key!r}], which row "
                         f"{request.index} (data_source {request.data_source!r}) lacks (its extra_info keys: "
                         f"{sorted(info)}): set reward.judge.question_key, or leave {{question}} out of the template")
    try:
        return template.format_map({
            "question": info.get(question_key, ""), "response": response, "data_source": request.data_source,
            "ground_truth": "" if request.ground_truth is None else request.ground_truth, "extra_info": info})
    except (KeyError, IndexError) as err:
        raise ValueError(f"the judge template reads {err} of row {request.index}, which it lacks (its extra_info "
                         f"keys: {sorted(info)})") from None


def _png_data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the judge sees the pixels the policy saw
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def visual_parts(request: RolloutRequest, config: JudgeConfig) -> tuple[list[dict], list[str]]:
    """The row's images and video frames as chat content parts, and what identifies each (its hash) in cache keys."""
    if not config.images:
        return [], []
    parts, keys = [], []
    for i, image in enumerate(request.images):
        parts.append({"type": "image_url", "image_url": {"url": _png_data_url(image)}})
        keys.append(request.image_hashes[i] if i < len(request.image_hashes) else _pixels_hash(image))
    if config.video_frames > 0:
        from PIL import Image

        for video in request.videos:
            total = video.num_frames
            picks = sorted({round(k * (total - 1) / max(config.video_frames - 1, 1))
                            for k in range(min(config.video_frames, total))})
            for index in picks:
                parts.append({"type": "image_url",
                              "image_url": {"url": _png_data_url(Image.fromarray(video.frames[index]))}})
                keys.append(f"video:{video.hash or hashlib.sha256(video.frames.tobytes()).hexdigest()}:{index}")
    return parts, keys


def _pixels_hash(image: Any) -> str:
    return hashlib.sha256(f"{image.size}:{image.mode}".encode() + image.tobytes()).hexdigest()
