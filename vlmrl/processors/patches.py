"""The processor of the patch layout (`InputFormat.image_layout == "patches"`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5 and their MoE models, GLM-4.1V. An image is resized once, as the model's image processor sizes it (sides
multiples of patch size x merge size, within the pixel bounds), and its placeholder expands to one token per merged
patch; videos are sampled and sized alike (`vlmrl.processors.video`); position ids are 3D mrope
(`vlmrl.processors.rope`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlmrl.processors.base import Processor
from vlmrl.processors.bounds import image_bounds
from vlmrl.processors.images import ImageSizing, resize_image
from vlmrl.processors.rope import mrope_position_ids
from vlmrl.types import RolloutRequest


class PatchesProcessor(Processor):
    """`Processor` for a patch-layout family (build with `vlmrl.processors.loading.load_processor`)."""

    def _image_setup(self, model_config: dict) -> None:
        """The image facts of the family's layout (here "patches": patch and merge sizes, pixel bounds)."""
        self.patch_size: int = int(self.image_processor.patch_size)
        self.spatial_merge_size: int = int(self.image_processor.merge_size)
        self.temporal_patch_size: int = int(self.image_processor.temporal_patch_size)
        self.image_factor: int = self.patch_size * self.spatial_merge_size
        """Resized image sides are multiples of this: the model's patch size x merge size."""
        self.min_pixels, self.max_pixels = self._pixel_bounds()
        size = self.image_processor.size
        self.sizing = ImageSizing(self.image_factor, self.min_pixels, self.max_pixels,
                                  self.family.inputs.image_bound_copies,
                                  (int(size["shortest_edge"]), int(size["longest_edge"])))
        """How images are resized: as the model's image processor sizes them, within min_pixels..max_pixels."""

    def prepare_image(self, image: Any, what: str) -> Any:
        """A decoded dataset image -> the image every backend gets (here RGB, resized as the model's image processor
        sizes it within the pixel bounds: sides multiples of `image_factor`)."""
        return resize_image(image, self.sizing, what)

    def image_summary(self) -> str:
        """How images are prepared, for the log."""
        return f"images {self.min_pixels}..{self.max_pixels} pixels, factor {self.image_factor}"

    def _pixel_bounds(self) -> tuple[int, int]:
        """Config bounds, checked to lie within the model's (`vlmrl.processors.bounds.image_bounds`): the engines
        run the model's image processor, which must find our resized images already valid (else it resizes again
        and the two sides disagree)."""
        return image_bounds(self.config, self.image_processor.size, self.family.inputs.image_bound_copies)

    def image_grid_thw(self, images: Sequence[Any]) -> torch.Tensor:
        """(N, 3) long patch grid (t, h, w) of already-resized images, from their sizes (no pixel work)."""
        rows = [[1, im.height // self.patch_size, im.width // self.patch_size] for im in images]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def image_token_count(self, image: Any) -> int:
        """How many `<|image_pad|>` tokens one resized image expands to."""
        return (image.height // self.patch_size) * (image.width // self.patch_size) // self.spatial_merge_size**2

    def _expansion(self, token: int, grid: Sequence[int]) -> list[int]:
        """The tokens one placeholder of an image / video with this (t, h, w) grid stands for: one per merged patch."""
        t, h, w = grid
        return [token] * (t * h * w // self.spatial_merge_size**2)

    def multi_modal_inputs(self, request: RolloutRequest) -> dict[str, torch.Tensor]:
        """{"pixel_values": (patches, C*T*p*p), "image_grid_thw": (N, 3)} for the trainer (and with videos
        "pixel_values_videos", "video_grid_thw" (V, 3), and for Qwen2/2.5-VL "second_per_grid_ts" (V,)); {} without
        images or videos."""
        video_inputs = self.video.inputs(request.videos, request.uid) if request.videos else {}
        if not request.images:
            return video_inputs
        out = self.image_processor(images=list(request.images), return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.long)
        expected = self.image_grid_thw(request.images)
        if not torch.equal(grid, expected):  # the image processor resized again: trainer and engines would disagree
            raise RuntimeError(f"request {request.uid}: image processor grid {grid.tolist()} != the resized images' "
                               f"{expected.tolist()}; check min_pixels/max_pixels against the model's processor")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid, **video_inputs}

    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(3, B, L) mrope ids of (B, L) EXPANDED ids; equal to transformers' `get_rope_index` (0 on padding).
        image_grid_thw / video_grid_thw (+ second_per_grid_ts): every image / video of the batch, in row then prompt
        order (a video's grid whole: Qwen3-VL's are split per temporal patch here, as its get_rope_index does)."""
        return mrope_position_ids(input_ids, attention_mask, image_grid_thw, image_token_id=self.image_token_id,
                                  spatial_merge_size=self.spatial_merge_size, video_token_id=self.video_token_id,
                                  video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts,
                                  tokens_per_second=self.video.tokens_per_second,
                                  video_per_frame=self.family.inputs.timestamps_in_text)
