"""Videos: load (a file or bytes decoded with PyAV, or a list of frame images), sample frames by qwen-vl-utils' rules,
resize them once, hash them.

Every video reaches the engines and the trainer through here, once: the frames are sampled ONCE (fps or nframes,
within [min_frames, max_frames], a multiple of the temporal patch size) and resized ONCE by the model's own video
processor's rule (`vlmrl.processors.images.processor_size`: sides multiples of the model's factor, 28 or 32, each
frame within [video_min_pixels, video_max_pixels] and all frames together within video_total_pixels and, for
Qwen3-VL, within its video processor's per-video bounds), so every backend gets the same uint8 frames and the same
timing (`vlmrl.types.Video`), and no engine samples or resizes again.

The timing reaches the model as its family carries it (`InputFormat.video_timing`): Qwen2/2.5-VL through
second_per_grid_ts in the position ids; Qwen3-VL as `<x.x seconds>` text before each temporal patch
(`VideoSupport.expansion`), its grid split per temporal patch for the position ids.

Decoding uses PyAV (`av`, already brought by qwen-vl-utils): torchvision's video reader is not in the CPU stack and
decord is not installed. Paths follow the image rules: under data.data_root, remote URLs only with
allow_remote_images.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmrl.data.config import DataConfig
from vlmrl.processors.bounds import video_frame_bounds
from vlmrl.processors.images import (ImageInputError, _fetch, _resolve_path, load_image, processor_size, source_name,
                                     to_8bit)
from vlmrl.types import Video

FRAME_FACTOR = 2
"""Sampled frame counts are multiples of this: Qwen2/2.5-VL's temporal patch size (qwen-vl-utils' FRAME_FACTOR)."""


class VideoInputError(ImageInputError):
    """A video that cannot be used; `Processor.build_request` turns it into a row error or a counted skip."""


# ---------------------------------------------------------------------------------------------------- sampling


def sample_count(total_frames: int, video_fps: float, config: DataConfig, what: str = "the video") -> int:
    """How many frames to sample from a video of `total_frames` at `video_fps` (qwen-vl-utils' `smart_nframes`):
    `video_nframes` when set, else duration x `video_fps` clamped to [video_min_frames, video_max_frames], rounded
    down to a multiple of 2. Raises VideoInputError (naming the video by `what`) when the video holds fewer frames
    than that minimum, or when `video_nframes` asks for more than video_max_frames.

    >>> cfg = DataConfig()
    >>> sample_count(300, 30.0, cfg)  # 10 s at 2 fps
    20
    >>> sample_count(12, 24.0, cfg)  # half a second: the 4-frame minimum
    4
    """
    if config.video_nframes is not None:
        wanted = _round_to(config.video_nframes, FRAME_FACTOR)
        if wanted > config.video_max_frames:
            raise VideoInputError(f"{what}: data.video_nframes={config.video_nframes} asks for more frames than "
                                  f"data.video_max_frames={config.video_max_frames} (the frame budget)")
    else:
        low = _ceil_to(config.video_min_frames, FRAME_FACTOR)
        high = _floor_to(min(config.video_max_frames, total_frames), FRAME_FACTOR)
        wanted = _floor_to(min(max(total_frames / video_fps * config.video_fps, low), high, total_frames),
                           FRAME_FACTOR)
        if total_frames < low:
            raise VideoInputError(f"{what} has {total_frames} frames, fewer than data.video_min_frames={low}")
    if not FRAME_FACTOR <= wanted <= total_frames:
        raise VideoInputError(f"cannot sample {wanted} frames from {what} of {total_frames} frames "
                              f"(need {FRAME_FACTOR}..{total_frames})")
    return wanted


def sample_indices(total_frames: int, count: int) -> list[int]:
    """`count` frame indices spread evenly from the first frame to the last (qwen-vl-utils' linspace + round).

    >>> sample_indices(10, 4)
    [0, 3, 6, 9]
    """
    return [int(i) for i in np.round(np.linspace(0, total_frames - 1, count))]


def frame_size(height: int, width: int, num_frames: int, config: DataConfig, bounds: tuple[int, int],
               factor: int, what: str = "the video", per_video: bool = False) -> tuple[int, int]:
    """(height, width) every frame is resized to: each frame within [min, max] pixels, where max shrinks so that all
    frames together stay within video_total_pixels (counted per temporal patch of 2 frames, as qwen-vl-utils does),
    sized by the model's video processor's rule (`processor_size`: qwen2_vl's per frame, or glm4v's over the
    `num_frames` frames together where `per_video`, Qwen3-VL's). `bounds` are the per-frame (min, max) pixels, already
    checked against the model's video processor.

    >>> frame_size(1114, 69, 4, DataConfig(), (3136, 12544), 28)  # a frame's short side keeps one factor
    (448, 28)
    """
    low, high = bounds
    if low * num_frames / FRAME_FACTOR > config.video_total_pixels:  # even the smallest frames do not fit
        raise VideoInputError(f"{what}: {num_frames} frames cannot fit data.video_total_pixels="
                              f"{config.video_total_pixels} "
                              f"at data.video_min_pixels={low} per frame (over the pixel budget): sample fewer "
                              "frames (data.video_fps / video_max_frames) or raise video_total_pixels")
    try:
        budget = min(max(min(high, config.video_total_pixels / num_frames * FRAME_FACTOR), int(low * 1.05)), high)
        copies = num_frames if per_video else 1
        return processor_size(height, width, factor, low * copies, int(budget) * copies,
                              frames=num_frames if per_video else None)
    except ValueError as err:  # aspect ratio over 200:1
        raise VideoInputError(f"cannot resize the {width}x{height} frames of {what}: {err}") from err


def _round_to(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil_to(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor_to(n: float, f: int) -> int:
    return math.floor(n / f) * f


# ---------------------------------------------------------------------------------------------------- loading


Bounds = tuple[int, int] | Callable[[int, str], tuple[int, int]]
"""Per-frame (min, max) pixels, or a function of the sampled frame count (and the video's name, for its errors)
giving them (a model whose video processor bounds the pixels of all frames together)."""


@dataclass(frozen=True)
class FrameSizing:
    """How a video's frames are resized (`VideoSupport.sizing`): by the model's video processor's rule, within
    vlmrl's bounds, to a size that processor keeps."""

    factor: int
    """Frame sides are multiples of this: the model's patch size x merge size."""
    bounds: Bounds
    """The per-frame (min, max) pixels vlmrl sizes within (data.video_min_pixels / video_max_pixels or the model's)."""
    model_bounds: tuple[int, int] | None = None
    """The model's video processor's own (shortest_edge, longest_edge): what the engines and the trainer resize by;
    per frame, or per video where `per_video`. None: sizes are not checked against it."""
    per_video: bool = False
    """The processor's bounds hold for all frames of a video together (`InputFormat.video_bounds_per_video`)."""

    def size(self, height: int, width: int, num_frames: int, config: DataConfig, what: str) -> tuple[int, int]:
        """(height, width) the frames of `what` are resized to; VideoInputError where the model's video processor
        refuses them, or would resize the result again (the engines, which get the resized frames, would count other
        tokens than the trainer)."""
        per_frame = self.bounds(num_frames, what) if callable(self.bounds) else self.bounds
        new = frame_size(height, width, num_frames, config, per_frame, self.factor, what, self.per_video)
        if self.model_bounds is None:
            return new
        try:
            again = processor_size(*new, self.factor, *self.model_bounds,
                                   frames=num_frames if self.per_video else None)
        except ValueError as err:
            again, reason = None, str(err)
        else:
            reason = f"resizes them again to {again[1]}x{again[0]}"
        if again != new:
            raise VideoInputError(f"the {width}x{height} frames of {what} resize to {new[1]}x{new[0]} (as the model's "
                                  f"video processor sizes them, within the pixel budget), but the engines' video "
                                  f"processor {reason}: its token count would differ between the trainer and the "
                                  "engines (crop or pad the video)")
        return new


def load_video(source: Any, config: DataConfig, sizing: FrameSizing) -> Video:
    """One dataset video -> a sampled, resized `Video`.

    Accepts a path (`file://` allowed; under data.data_root), raw bytes, {"bytes"/"path"}, an http(s) URL when
    allow_remote_images, or a list of frame images (anything `load_image` takes; taken as sampled at data.video_fps,
    padded to an even count by repeating the last frame, as qwen-vl-utils does). Raises VideoInputError.
    """
    if isinstance(source, dict) and source.get("video") is not None:  # a content part carrying its video inline
        source = source["video"]
    if isinstance(source, (list, tuple)):
        return _from_frames(list(source), config, sizing)
    data, what = _read_bytes(source, config)
    frames, fps = decode(data, what, config)
    total = len(frames)
    indices = sample_indices(total, sample_count(total, fps, config, what))
    picked = [frames[i] for i in indices]
    return _finish(picked, fps, indices, total, config, sizing, what)


def _from_frames(sources: list[Any], config: DataConfig, sizing: FrameSizing) -> Video:
    if not sources:
        raise VideoInputError("the video is an empty list of frames")
    what = source_name(sources, "video")
    frames = []
    for i, src in enumerate(sources):
        try:
            frames.append(to_8bit(load_image(src, config)).convert("RGB"))
        except ImageInputError as err:
            raise VideoInputError(f"frame {i}: {err}") from err
    if len(frames) < config.video_min_frames:
        raise VideoInputError(f"{what} has {len(frames)} frames, fewer than data.video_min_frames="
                              f"{config.video_min_frames}")
    if len(frames) > config.video_max_frames:
        raise VideoInputError(f"{what} has {len(frames)} frames, more than data.video_max_frames="
                              f"{config.video_max_frames} (the frame budget)")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise VideoInputError(f"the frames of {what} differ in size ({sorted(sizes)[:3]}): a video's frames share one "
                              "size")
    count = _ceil_to(len(frames), FRAME_FACTOR)
    frames += [frames[-1]] * (count - len(frames))
    return _finish(frames, config.video_fps, list(range(count)), count, config, sizing, what)


def _finish(frames: Sequence[Image.Image], fps: float, indices: list[int], total: int, config: DataConfig,
            sizing: FrameSizing, what: str) -> Video:
    width, height = frames[0].size
    new_h, new_w = sizing.size(height, width, len(frames), config, what)
    resized = np.stack([np.asarray(f.resize((new_w, new_h), Image.Resampling.BICUBIC)
                                   if f.size != (new_w, new_h) else f) for f in frames])
    video = Video(frames=resized, fps=float(fps), frame_indices=indices, total_frames=int(total))
    video.hash = video_hash(video)
    return video


def _read_bytes(source: Any, config: DataConfig) -> tuple[bytes, str]:
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return bytes(source["bytes"]), source_name(source, "video")
        if source.get("path"):
            source = source["path"]
        else:
            raise VideoInputError(f"video entry has neither bytes nor path (keys: {sorted(source)})")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "video bytes"
    if not isinstance(source, (str, Path)):
        raise VideoInputError(f"unsupported video value of type {type(source).__name__}")
    value = str(source)
    if value.startswith(("http://", "https://")):
        if not config.allow_remote_images:
            raise VideoInputError(f"remote video URL {value[:200]!r} is not allowed: set allow_remote_images=true "
                                  "to fetch it, or store the video in the dataset")
        try:
            return _fetch(value, config), f"video from {value[:200]}"
        except ImageInputError as err:
            raise VideoInputError(str(err).replace("image", "video")) from err
    try:
        path = _resolve_path(value.removeprefix("file://"), config.data_root)
    except ImageInputError as err:
        raise VideoInputError(str(err).replace("image path", "video path")) from err
    try:
        return path.read_bytes(), f"video file {path}"
    except FileNotFoundError as err:
        raise VideoInputError(f"video file not found: {path}") from err
    except OSError as err:
        raise VideoInputError(f"cannot read video file {path}: {err}") from err


def decode(data: bytes, what: str, config: DataConfig) -> tuple[list[Image.Image], float]:
    """All frames of the first video stream as RGB images, and the stream's frame rate. Stops with an error past
    video_max_decoded_frames (a long video must not fill memory before sampling)."""
    import av

    if not data:
        raise VideoInputError(f"{what} is empty (0 bytes)")
    frames: list[Image.Image] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoInputError(f"{what} holds no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            for frame in container.decode(stream):
                frames.append(frame.to_image())
                if len(frames) > config.video_max_decoded_frames:
                    raise VideoInputError(f"{what} has over data.video_max_decoded_frames="
                                          f"{config.video_max_decoded_frames} frames (the decode budget)")
    except VideoInputError:  # ours, from inside the block (a ValueError too): already says what is wrong
        raise
    except (av.FFmpegError, ValueError, OSError) as err:
        raise VideoInputError(f"{what} is not a readable video: {err}") from err
    if not frames:
        raise VideoInputError(f"{what} holds no frames")
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise VideoInputError(f"{what} declares no frame rate")
    return frames, fps


def video_hash(video: Video) -> str:
    """sha256 over the frames' shape and bytes and the timing (fps, indices, total): the same frames at another fps
    hash differently, since the model's position ids depend on it."""
    digest = hashlib.sha256(f"{video.frames.shape}:{video.fps!r}:{video.total_frames}:{video.frame_indices}:".encode())
    digest.update(np.ascontiguousarray(video.frames, dtype=np.uint8).tobytes())
    return digest.hexdigest()


def frame_hashes(video: Video) -> list[str]:
    """sha256 (16 hex digits) of each frame's pixels, for the alignment artifact."""
    return [hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()[:16] for f in video.frames]


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """(T, H, W, 3) uint8 frames as an H.264 mp4 at `fps` (lossy): for test data and the synthetic video task."""
    from fractions import Fraction

    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = int(frames.shape[2]), int(frames.shape[1]), "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------------- the model side


class VideoSupport:
    """The model-specific video facts a `Processor` asks: frame bounds, grids, token counts, the trainer's inputs."""

    def __init__(self, hf_processor: Any, model_config: dict, config: DataConfig, factor: int, family: Any):
        self.config = config
        self.family = family
        self.video_processor = getattr(hf_processor, "video_processor", None)
        self.factor = factor
        vision = model_config.get("vision_config") or {}
        self.tokens_per_second: float = float(vision.get("tokens_per_second", 1.0))
        """Temporal position ids per second of video (Qwen2.5-VL: position = t_index x tokens_per_second x
        second_per_grid_t); Qwen2-VL has none (1 per temporal patch)."""
        self.temporal_patch_size = int(vision.get("temporal_patch_size", FRAME_FACTOR))
        patch = vision.get("patch_size", 14)  # InternViT writes [p, p]
        self.patch_size = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        self.merge = int(vision.get("spatial_merge_size", 2))
        self.model_type = str(model_config.get("model_type", ""))
        self.tokenizer = hf_processor.tokenizer
        vocab = self.tokenizer.convert_tokens_to_ids
        self.video_token_id = int(model_config.get("video_token_id", vocab(family.inputs.video_placeholder)))
        # the delimiters a Qwen3-VL video repeats around each temporal patch (None in a family without them)
        self.vision_start_id: int | None = _token_id(model_config, "vision_start_token_id", vocab("<|vision_start|>"))
        self.vision_end_id: int | None = _token_id(model_config, "vision_end_token_id", vocab("<|vision_end|>"))
        self.video_bounds: tuple[int, int] | None = None
        """Pixels of all frames of a video together, (min, max): the model's video processor's, where its bounds
        are per video (`InputFormat.video_bounds_per_video`); None where they are per frame (`bounds`)."""
        self.model_bounds: tuple[int, int] | None = None
        """The model's video processor's own (shortest_edge, longest_edge), per frame or per video; None: no video."""
        self.bounds = self._bounds()
        self.sizing = FrameSizing(factor, self.frame_bounds if self.video_bounds else self.bounds, self.model_bounds,
                                  per_video=self.video_bounds is not None)
        """How frames are resized: by the model's video processor's rule, within the bounds and the pixel budget."""

    def _bounds(self) -> tuple[int, int]:
        """Per-frame pixel bounds: the config's, checked to lie within the model's video processor's (which would
        resize the frames again otherwise, and the engines and the trainer would disagree)."""
        if self.video_processor is None or self.family.inputs.video_timing is None:  # no video: `load` refuses them
            return (self.config.video_min_pixels or 0, self.config.video_max_pixels or 0)
        size = self.video_processor.size
        model_min, model_max = int(size["shortest_edge"]), int(size["longest_edge"])
        self.model_bounds = (model_min, model_max)
        if self.family.inputs.video_bounds_per_video:  # checked per video, once its frame count is known
            self.video_bounds = (model_min, model_max)
            return (self.config.video_min_pixels or 0, self.config.video_max_pixels or model_max)
        return video_frame_bounds(self.config, size)

    def load(self, source: Any) -> Video:
        """A dataset video -> a sampled, resized `Video`. Any length: the position ids after a long video follow the
        engines' rule (`vlmrl.processors.rope`), which the hf backend and the trainer use too."""
        if self.video_processor is None:
            raise VideoInputError("the model's processor has no video processor: it takes no video")
        if self.family.inputs.video_timing is None:
            raise VideoInputError(f"vlmrl takes no video for {self.family.name}")
        video_types = self.family.inputs.video_model_types
        if video_types is not None and self.model_type not in video_types:
            raise VideoInputError(
                f"vlmrl takes no video for model_type {self.model_type!r} (video: "
                f"{', '.join(video_types)}); Qwen2-VL spaces a video's temporal position ids "
                "one per temporal patch, which vlmrl does not compute yet")
        return load_video(source, self.config, self.sizing)

    def frame_bounds(self, num_frames: int, what: str = "the video") -> tuple[int, int]:
        """Per-frame (min, max) pixels for `num_frames` frames where the model bounds a video's pixels summed over
        its frames (Qwen3-VL): its processor resizes every frame again unless frames x pixels lies within its
        bounds, so each frame gets that share of them, within data.video_min_pixels / video_max_pixels."""
        model_min, model_max = self.video_bounds
        frames = _ceil_to(num_frames, self.temporal_patch_size)
        low, high = max(self.bounds[0], math.ceil(model_min / frames)), min(self.bounds[1], model_max // frames)
        if low > high:
            raise VideoInputError(
                f"{what}: {num_frames} frames cannot fit the model's video processor bounds [{model_min}, {model_max}] "
                f"pixels per video with data.video_min_pixels={self.config.video_min_pixels}, "
                f"video_max_pixels={self.config.video_max_pixels} per frame (over the pixel budget): sample fewer "
                "frames (data.video_fps / video_nframes / video_max_frames) or change those bounds")
        return low, high

    def grid(self, video: Video) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one sampled video (before merging)."""
        t, height, width = video.frames.shape[:3]
        return (t // self.temporal_patch_size, height // self.patch_size, width // self.patch_size)

    def token_count(self, video: Video) -> int:
        """How many tokens one video's `<|video_pad|>` expands to (Qwen3-VL: with its timestamps and per-frame
        vision start/end tokens)."""
        if self.family.inputs.timestamps_in_text:
            return len(self.expansion(video))
        t, h, w = self.grid(video)
        return t * h * w // self.merge**2

    def timestamps(self, video: Video) -> list[float]:
        """Seconds of each temporal patch (Qwen3-VL): the mean time of its first and last frame, the frame count
        padded to the temporal patch size with the last frame (transformers' `Qwen3VLProcessor._calculate_timestamps`,
        vLLM's alike)."""
        size = self.temporal_patch_size
        indices = list(video.frame_indices)
        indices += [indices[-1]] * (-len(indices) % size)
        seconds = [i / video.fps for i in indices]
        return [(seconds[i] + seconds[i + size - 1]) / 2 for i in range(0, len(seconds), size)]

    def expansion(self, video: Video, grid: Sequence[int] | None = None) -> list[int]:
        """The ids that replace one video's `<|video_pad|>` for the trainer's forward (its `grid` (t, h, w), default
        the frames' own): one `<|video_pad|>` per merged patch; Qwen3-VL: per temporal patch
        `<x.x seconds><|vision_start|>` + its pads + `<|vision_end|>` (the chat template's own start/end tokens
        stay around the whole video: transformers 5.19's Qwen3VLProcessor, vLLM and SGLang expand alike). Each
        timestamp is tokenized alone, as vLLM and SGLang do (special tokens split the text the same way in HF's)."""
        t, h, w = grid if grid is not None else self.grid(video)
        per_frame = h * w // self.merge**2
        if not self.family.inputs.timestamps_in_text:
            return [self.video_token_id] * (t * per_frame)
        stamps = self.timestamps(video)
        if len(stamps) != t:
            raise ValueError(f"video of {video.num_frames} frames has {len(stamps)} temporal patches but grid t={t}")
        ids: list[int] = []
        for seconds in stamps:
            ids += self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            ids += [self.vision_start_id] + [self.video_token_id] * per_frame + [self.vision_end_id]
        return ids

    def second_per_grid(self, video: Video) -> float:
        """Seconds one temporal patch spans: temporal patch size / sample fps (transformers' second_per_grid_ts)."""
        return self.temporal_patch_size / video.sample_fps

    def inputs(self, videos: Sequence[Video], uid: str) -> dict[str, Any]:
        """{"pixel_values_videos", "video_grid_thw" (V, 3), "second_per_grid_ts" (V,)} through the model's own video
        processor, told not to sample (the frames are the sampled ones) and given each video's timing. Qwen3-VL: no
        second_per_grid_ts (its timing is in the text; its forward takes none)."""
        import torch

        out = self.video_processor(videos=[v.frames for v in videos], return_tensors="pt", do_sample_frames=False,
                                   video_metadata=[v.metadata() for v in videos])
        grid = out["video_grid_thw"].to(torch.long)
        expected = torch.tensor([self.grid(v) for v in videos], dtype=torch.long).reshape(-1, 3)
        if not torch.equal(grid, expected):
            raise RuntimeError(f"request {uid}: video processor grid {grid.tolist()} != the sampled frames' "
                               f"{expected.tolist()}; check video_min_pixels/video_max_pixels against the model's")
        if self.family.inputs.timestamps_in_text:
            return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid}
        seconds = torch.tensor([self.second_per_grid(v) for v in videos], dtype=torch.float32)
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid,
                "second_per_grid_ts": seconds}


def _token_id(model_config: dict, key: str, fallback: int | None) -> int | None:
    """config.json's id for `key`, else the tokenizer's for its usual token; None when neither names one."""
    value = model_config.get(key, fallback)
    return None if value is None else int(value)
