"""The processor of the tile layout (`InputFormat.image_layout == "tiles"`: InternVL3.5 in transformers' format):
`TilesProcessor`, the image methods of `vlmrl.processors.base.Processor` for tiled images. What differs from the
patch layout (`vlmrl.processors.patches`):

- An image is not resized: the model's image processor (GotOcr2's) cuts it into square tiles by its aspect ratio, plus
  a thumbnail when it takes more than one, and every backend runs that same processor on the same image. The row's
  image is only decoded and bounded (`data.max_image_pixels`); `data.min_pixels` / `max_pixels` do not apply.
- One placeholder (`<IMG_CONTEXT>`) per image in the prompt ids every engine gets; expanded (trainer, hf) it becomes
  `<img>` + tokens-per-tile x tiles `<IMG_CONTEXT>` + `</img>`, as transformers' InternVLProcessor writes it.
- `pixel_values` are (tiles, C, S, S). vlmrl's bookkeeping describes each image by the rows of `pixel_values` it
  owns as an `image_grid_thw` row (tiles, 1, 1), so that slicing, hashing and reports treat both layouts alike; the
  model's forward never sees it (`InputFormat.forward_inputs`).
- Position ids are 1-D (a Qwen3 language model): the three rows of vlmrl's batches are equal, and the forward takes
  the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlmrl.processors.base import Processor
from vlmrl.processors.bounds import tiles_bounds_problem
from vlmrl.types import RolloutRequest


class TilesProcessor(Processor):
    """`Processor` for a tile-layout family (build with `vlmrl.processors.loading.load_processor`)."""

    def _image_setup(self, model_config: dict) -> None:
        problem = tiles_bounds_problem(self.config, self.family.name)
        if problem:
            raise ValueError(problem)
        size = self.image_processor.size
        self.tile: int = int(size["height"])
        if int(size["width"]) != self.tile:
            raise ValueError(f"{self.family.name}: tiles of {size['height']}x{size['width']} pixels; vlmrl takes "
                             "square tiles (as the released models have)")
        self.tokens_per_tile: int = int(getattr(self.hf_processor, "image_seq_length", 0)
                                        or model_config["image_seq_length"])
        vocab = self.tokenizer.convert_tokens_to_ids
        self.image_start_id: int = int(vocab(self.tokenizer.start_image_token))
        self.image_end_id: int = int(vocab(self.tokenizer.end_image_token))
        self.banned_token_ids += [self.image_start_id, self.image_end_id]
        # the patch layout's facts, for code that asks (video sizing: this family takes no video)
        self.patch_size = self.spatial_merge_size = self.temporal_patch_size = 1
        self.image_factor = 1  # any size: the image processor tiles it
        self.min_pixels, self.max_pixels = 1, int(self.config.max_image_pixels)

    def image_summary(self) -> str:
        return (f"images as {self.tile}-pixel tiles (up to {self.image_processor.max_patches} + a thumbnail), "
                f"{self.tokens_per_tile} tokens a tile")

    def prepare_image(self, image: Any, what: str) -> Any:
        """Decoded and bounded already (`load_image`); only RGB, as the image processor would convert it."""
        return image if image.mode == "RGB" else image.convert("RGB")

    def tiles(self, image: Any) -> int:
        """The tiles (thumbnail included) the image processor cuts this image into."""
        return int(self.image_processor.get_number_of_image_patches(image.height, image.width, {}))

    def image_grid_thw(self, images: Sequence[Any]) -> torch.Tensor:
        """(N, 3) long: (tiles, 1, 1) per image, the rows of `pixel_values` each owns (bookkeeping only)."""
        return torch.tensor([[self.tiles(im), 1, 1] for im in images], dtype=torch.long).reshape(-1, 3)

    def image_token_count(self, image: Any) -> int:
        """Tokens one image expands to: `<img>`, tokens-per-tile x tiles `<IMG_CONTEXT>`, `</img>`."""
        return 2 + self.tokens_per_tile * self.tiles(image)

    def _expansion(self, token: int, grid: Sequence[int]) -> list[int]:
        if token != self.image_token_id:
            raise ValueError(f"{self.family.name}: vlmrl takes no video for this family")
        tiles = grid[0] * grid[1] * grid[2]
        return [self.image_start_id] + [token] * (self.tokens_per_tile * tiles) + [self.image_end_id]

    def multi_modal_inputs(self, request: RolloutRequest) -> dict[str, torch.Tensor]:
        """{"pixel_values": (tiles, C, S, S), "image_grid_thw": (N, 3) of (tiles, 1, 1)}; {} without images."""
        if request.videos:
            raise ValueError(f"{self.family.name}: vlmrl takes no video for this family")
        if not request.images:
            return {}
        out = self.image_processor(images=list(request.images), return_tensors="pt")
        grid = self.image_grid_thw(request.images)
        tiles = torch.as_tensor(out["num_patches"], dtype=torch.long)
        if not torch.equal(tiles, grid[:, 0]) or out["pixel_values"].shape[0] != int(tiles.sum()):
            raise RuntimeError(f"request {request.uid}: the image processor cut {tiles.tolist()} tiles, vlmrl counted "
                               f"{grid[:, 0].tolist()}: the prompt's expansion would not match the features")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}

    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(3, B, L) equal rows of 1-D positions: 0, 1, ... over each row's attended tokens, 0 on padding."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0) * (mask != 0)
        return positions.unsqueeze(0).expand(3, -1, -1).contiguous()
