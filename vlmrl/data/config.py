"""Data configuration (the run config's `data` section): datasets, batch sizes, lengths, and how a row's images and
videos become a rollout request (sizing, safety, bad rows). The processor is built from this section
(`vlmrl.processors.loading.load_processor(model_path, config.data)`).
"""

from __future__ import annotations

from dataclasses import dataclass

BAD_IMAGE_POLICIES = ("error", "filter")
IMAGE_PATCH_PIXELS = 28 * 28  # pixels per image token of Qwen2/2.5-VL (14x14 patches, 2x2 merged)


@dataclass
class DataConfig:
    train_files: str = ""
    """Training data: parquet file(s) in the verl/EasyR1 schema (comma-separated, globs allowed), or `synthetic` for
    the embedded visual task."""
    val_files: str = ""
    """Validation data, same forms as train_files (`synthetic`: the task's held-out split). Empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    image_key: str = "images"
    """Column holding the images ({bytes} / {path} / PIL)."""
    train_batch_size: int = 512
    """Prompts per training step (each is sampled rollout.n times)."""
    val_batch_size: int = -1
    """Prompts per validation generate call; -1 = the whole validation set in one call."""
    max_response_length: int = 2048
    """Most tokens generated per sample."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded by trainer.seed)."""
    synthetic_train_size: int = 2048
    """Rows in the synthetic task's train split (only for `synthetic`)."""
    synthetic_val_size: int = 128
    """Rows in the synthetic task's held-out split (only for `synthetic`)."""
    min_pixels: int | None = None
    """Images smaller than this many pixels are upscaled (as the model's own image processor sizes them: sides
    multiples of its patch x merge size, 28 for Qwen2/2.5-VL); null = the model's image processor's bound
    (`size.shortest_edge`). Must lie within the model's bounds, or the engines would resize the image again."""
    max_pixels: int | None = None
    """Images larger than this many pixels are downscaled (e.g. 1003520 = 1280 * 28 * 28); null = the model's image
    processor's bound (`size.longest_edge`). Must lie within the model's bounds, or the engines would resize the image
    again."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens, counted EXPANDED (one token per merged image patch, as the trainer sees it)."""
    filter_overlong_prompts: bool = True
    """Drop (and count) prompts over max_prompt_length; False makes them an error naming the row. A prompt is never
    truncated: cutting through an image breaks every consumer."""
    on_bad_image: str = "error"
    """A corrupt, missing, empty, oversized or disallowed image or video (too few frames, over the frame or pixel
    budget), or a row whose image/video count differs from its placeholders: "error" stops with the row named,
    "filter" skips the row (counted and logged)."""
    data_root: str | None = None
    """Folder image paths live in: relative paths resolve under it and no path may point outside it (symlinks and
    '..' resolved first). null = paths are taken as given (relative to the working directory)."""
    allow_remote_images: bool = False
    """Fetch http(s) image URLs found in the data. Off: a dataset cannot make the trainer reach the network."""
    remote_timeout_s: float = 10.0
    """Deadline of one remote image fetch (the whole download; connect and headers: each read), when
    allow_remote_images."""
    remote_max_bytes: int = 32 * 1024 * 1024
    """Largest remote image accepted, in bytes (32 MiB); the download stops past it."""
    max_image_pixels: int = 89_478_485
    """Decompression-bomb guard: an image whose header declares more pixels than this is rejected before it is
    decoded (PIL's default). Not a resize bound: see max_pixels."""

    video_fps: float = 2.0
    """Frames sampled per second of video (qwen-vl-utils' `fps`); also the rate a video given as a list of frame
    images was taken at."""
    video_nframes: int | None = None
    """Sample exactly this many frames per video (rounded to a multiple of 2) instead of by video_fps."""
    video_min_frames: int = 4
    """Fewest frames sampled from a video; a video with fewer frames is a bad input (qwen-vl-utils' FPS_MIN_FRAMES)."""
    video_max_frames: int = 768
    """Most frames sampled from a video (the frame budget; qwen-vl-utils' FPS_MAX_FRAMES)."""
    video_min_pixels: int | None = None
    """Each frame is resized to at least this many pixels; null = the model's video processor's bound (Qwen3-VL's
    bounds all frames together: null = a frame's share of it)."""
    video_max_pixels: int | None = None
    """Each frame is resized to at most this many pixels; null = the model's video processor's bound (Qwen3-VL's
    bounds all frames together: null = a frame's share of it)."""
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)
    """All of a video's frames together stay within this many pixels (per temporal patch of 2 frames: a frame gets
    at most video_total_pixels / frames * 2); qwen-vl-utils' default. A video that cannot fit at video_min_pixels
    per frame is over the pixel budget: a bad input."""
    video_max_decoded_frames: int = 100_000
    """A video file with more frames than this is refused before sampling (decoding keeps every frame in memory)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid. The image and video bounds are checked against
        the model's processor as the config loads (`vlmrl.processors.bounds`, for a local model) and as it loads."""
        out = []
        for name in ("train_batch_size", "max_response_length"):
            if getattr(self, name) < 1:
                out.append(f"data.{name}={getattr(self, name)} must be >= 1")
        if self.max_prompt_length < 1:
            out.append(f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        low, high = self.min_pixels, self.max_pixels
        if low is not None and high is not None and low > high:
            out.append(f"data.min_pixels={low} > data.max_pixels={high}")
        if low is not None and low < IMAGE_PATCH_PIXELS:
            out.append(f"data.min_pixels={low} is below one 28x28 patch ({IMAGE_PATCH_PIXELS})")
        if self.on_bad_image not in BAD_IMAGE_POLICIES:
            out.append(f"data.on_bad_image={self.on_bad_image!r} is not one of {list(BAD_IMAGE_POLICIES)}")
        for name in ("remote_timeout_s", "remote_max_bytes", "max_image_pixels"):
            if getattr(self, name) <= 0:
                out.append(f"data.{name}={getattr(self, name)} must be > 0")
        if high is not None and self.max_image_pixels < high:
            out.append(max_image_pixels_problem(self.max_image_pixels, high))
        if not self.video_fps > 0:
            out.append(f"data.video_fps={self.video_fps} must be > 0")
        if self.video_nframes is not None and self.video_nframes < 2:
            out.append(f"data.video_nframes={self.video_nframes} must be >= 2 (or null to sample by video_fps)")
        if not 2 <= self.video_min_frames <= self.video_max_frames:
            out.append(f"data.video_min_frames={self.video_min_frames} and video_max_frames={self.video_max_frames} "
                       "must satisfy 2 <= min <= max")
        vlow, vhigh = self.video_min_pixels, self.video_max_pixels
        if vlow is not None and vhigh is not None and vlow > vhigh:
            out.append(f"data.video_min_pixels={vlow} > data.video_max_pixels={vhigh}")
        for name in ("video_total_pixels", "video_max_decoded_frames"):
            if getattr(self, name) <= 0:
                out.append(f"data.{name}={getattr(self, name)} must be > 0")
        return out


def max_image_pixels_problem(max_image_pixels: int, max_pixels: int) -> str:
    """The guard would reject images the resize bound allows (checked again against the model's bound at load)."""
    return (f"data.max_image_pixels={max_image_pixels} rejects images data.max_pixels={max_pixels} allows after "
            "resizing: raise data.max_image_pixels")
