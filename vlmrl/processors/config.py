"""Processor configuration: image sizing, prompt length limits and what to do with bad rows."""

from __future__ import annotations

from dataclasses import dataclass

OVERLONG_POLICIES = ("filter", "error")
BAD_IMAGE_POLICIES = ("error", "filter")


@dataclass
class ProcessorConfig:
    """How dataset rows become rollout requests (`vlmrl.processors.load_processor(path, config)`)."""

    min_pixels: int | None = None
    """Lower bound on a resized image's pixel count; None = the model's image processor's (`size.shortest_edge`).
    Must lie within the model's bounds, or the engines would resize the image again."""
    max_pixels: int | None = None
    """Upper bound on a resized image's pixel count; None = the model's image processor's (`size.longest_edge`).
    Must lie within the model's bounds, or the engines would resize the image again."""
    image_factor: int = 28
    """Resized sides are multiples of this (qwen-vl-utils' rule): patch size 14 x spatial merge 2 for Qwen2/2.5-VL.
    Checked against the model's image processor at load."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens, counted EXPANDED (one token per merged image patch, as the trainer sees it)."""
    on_overlong: str = "filter"
    """A prompt over `max_prompt_length`: "filter" skips the row (counted and logged by the data loader) or "error"
    raises. A prompt is never truncated: cutting through an image breaks every consumer."""
    on_bad_image: str = "error"
    """A corrupt, missing, empty, oversized or disallowed image, or a row whose image count differs from its
    placeholders: "error" raises naming the row, "filter" skips it (counted and logged)."""
    data_root: str | None = None
    """Folder that image paths live in: relative paths resolve under it, and no path (relative or absolute, after
    resolving symlinks and '..') may point outside it. None = paths are taken as given (relative to the working dir)."""
    allow_remote_images: bool = False
    """Fetch http(s) image URLs. Off by default: a dataset should not make the trainer reach the network."""
    remote_timeout_s: float = 10.0
    """Deadline of one remote image fetch (the whole download; connect and headers: each read), when
    `allow_remote_images`."""
    remote_max_bytes: int = 32 * 1024 * 1024
    """Largest remote image accepted, in bytes; the download stops past it."""
    max_image_pixels: int = 89_478_485
    """Decompression-bomb guard: an image whose header declares more pixels than this is rejected before it is
    decoded (PIL's own default limit)."""

    def __post_init__(self) -> None:
        if self.on_overlong not in OVERLONG_POLICIES:
            raise ValueError(f"on_overlong={self.on_overlong!r}: use one of {OVERLONG_POLICIES}")
        if self.on_bad_image not in BAD_IMAGE_POLICIES:
            raise ValueError(f"on_bad_image={self.on_bad_image!r}: use one of {BAD_IMAGE_POLICIES}")
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length}: must be >= 1")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}: lower min_pixels")
        if self.max_image_pixels < 1 or self.remote_max_bytes < 1 or self.remote_timeout_s <= 0:
            raise ValueError("max_image_pixels, remote_max_bytes and remote_timeout_s must be positive")
