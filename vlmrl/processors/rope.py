"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL 3D (mrope) position ids, vectorised over the whole batch.

The one function that owns position ids, so that no two places disagree on their shape or layout: the trainer, the
padding code, the hf backend and every backend-side check ask it. It computes Qwen's original `get_rope_index` (what
the model was trained with, and what vLLM and SGLang compute), not transformers 5.19's where the two differ: after a
long video transformers continues the text at `s + max(h, w)`, the model and both engines at the video's largest
position + 1, so the hf backend is given these ids too. Video temporal ids are multiplied in float32 (Qwen's code,
SGLang); vLLM's float64 puts one temporal patch in ~2% of videos one lower, and vlmrl keeps the model's rule.
Qwen3-VL splits each video's grid per temporal patch (`split_video_frames`). The layout rules, token by token, and
the measurements: docs/engines.md, "Position ids". transformers loops over samples and token groups in Python; here
every step is one tensor op over (B, L)."""

from __future__ import annotations

import torch


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_token_id: int | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    tokens_per_second: float = 1.0,
    video_per_frame: bool = False,
) -> torch.Tensor:
    """3D rope position ids for a batch of EXPANDED ids.

    Args:
        input_ids: (B, L) long, one `image_token_id` per merged vision patch.
        attention_mask: (B, L), 1 on real tokens; None = all real. Left, right or both-side padding and holes in
            text all work; a hole inside an image's tokens is an error.
        image_grid_thw: (N, 3) long, the patch grid (before merging) of every image of the batch, in row order
            then prompt order; None or empty when no row holds an image.
        image_token_id: the `<|image_pad|>` id.
        spatial_merge_size: patches merged per side into one token (2 for Qwen2/2.5-VL).
        video_token_id: the `<|video_pad|>` id (None: the ids hold no video).
        video_grid_thw: (V, 3) long, the patch grid of every video of the batch, in row then prompt order.
        second_per_grid_ts: (V,) seconds per temporal patch of each video (None: 1.0 each, transformers' default).
        tokens_per_second: the model's vision_config.tokens_per_second (Qwen2.5-VL; 1.0 leaves t_i as it is).
        video_per_frame: Qwen3-VL: each video is t one-frame items (`split_video_frames`), each its own run of
            video tokens between its timestamp text; second_per_grid_ts and tokens_per_second are then unused.

    Returns:
        (3, B, L) long: temporal, height, width positions; 0 on padding.

    Raises:
        ValueError: the image (video) tokens do not match `image_grid_thw` (`video_grid_thw`): count of images or
            tokens of one image, naming the batch row.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got shape {tuple(input_ids.shape)}")
    if video_per_frame and video_grid_thw is not None:
        video_grid_thw, second_per_grid_ts = split_video_frames(video_grid_thw), None
    batch, length = input_ids.shape
    device = input_ids.device
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    # transformers drops padding and lays the attended tokens out packed: index j among the attended tokens
    # (in-place ops below: fresh (B, L) buffers cost more in page faults than the arithmetic itself)
    packed = torch.cumsum(valid, dim=1).sub_(1)  # (B, L) long
    is_image = (input_ids == image_token_id) & valid  # (B, L)
    is_video = (input_ids == video_token_id) & valid if video_token_id is not None else torch.zeros_like(is_image)
    # An image (video) is a run of image (video) tokens. (A masked hole inside a run splits it here, where
    # transformers would merge the halves; the halves then fail the length check below instead of giving a silent
    # answer.) Below, "image" means any vision item, image or video, in flat (row, column) order.
    image_start = is_image.clone()
    image_start[:, 1:] &= ~is_image[:, :-1]
    video_start = is_video.clone()
    video_start[:, 1:] &= ~is_video[:, :-1]
    image_grid = _merged_grid(image_grid_thw, int(image_start.sum()), image_start.sum(dim=1), spatial_merge_size,
                              device, "image")
    video_grid = _merged_grid(video_grid_thw, int(video_start.sum()), video_start.sum(dim=1), spatial_merge_size,
                              device, "video")
    is_image = is_image | is_video
    run_start = image_start | video_start
    num_images = int(run_start.sum())
    # items in flat order: each run start takes the next grid of its own modality
    starts_flat = run_start.flatten().nonzero().squeeze(1)
    video_item = video_start.flatten()[starts_flat]  # (N,) bool
    grid = torch.zeros(num_images, 3, dtype=torch.long, device=device)
    grid[~video_item] = image_grid
    grid[video_item] = video_grid
    # temporal position of index t_i: floor((t_i * seconds) * rate), float32; images keep t_i (seconds = rate = 1)
    seconds = torch.ones(num_images, dtype=torch.float32, device=device)
    rate = torch.ones(num_images, dtype=torch.float32, device=device)
    if int(video_item.sum()):
        given = (torch.ones(video_grid.shape[0], dtype=torch.float32, device=device) if second_per_grid_ts is None
                 else torch.as_tensor(second_per_grid_ts, dtype=torch.float32, device=device).reshape(-1))
        if given.numel() != video_grid.shape[0]:
            raise ValueError(f"second_per_grid_ts has {given.numel()} values for {video_grid.shape[0]} videos")
        seconds[video_item] = given
        rate[video_item] = float(tokens_per_second)
    tokens_per_image = grid.prod(dim=1)  # (N,)
    # how far positions jump past an item's start: its largest position + 1 (t, h or w)
    last_t = _temporal((grid[:, 0] - 1).clamp_(min=0), seconds, rate)
    span = torch.maximum(torch.maximum(grid[:, 1], grid[:, 2]), last_t + 1)
    _check_image_lengths(is_image, run_start, tokens_per_image)

    # Each image occupies `tokens` columns but advances later positions by `span`: accumulate the difference.
    shift = torch.zeros(batch, length, dtype=torch.long, device=device)
    if num_images:
        shift[run_start] = span - tokens_per_image
    text_pos = packed.add_(shift.cumsum_(dim=1))  # (B, L): position of a text token (all three rows)
    text_pos.masked_fill_(~valid, 0)
    positions = text_pos.unsqueeze(0).expand(3, batch, length).clone()  # (3, B, L)
    if num_images:
        flat = positions.view(3, -1)
        tokens = is_image.flatten().nonzero().squeeze(1)  # flat index of every image token
        starts = run_start.flatten().nonzero().squeeze(1)  # flat index of every image's first token, image order
        image = torch.repeat_interleave(torch.arange(num_images, device=device), tokens_per_image)  # (T,)
        offset = tokens - starts[image]  # token offset within its image (runs hold no padding)
        # an image starts where a text token there would sit
        start = text_pos.flatten()[starts][image] - (span - tokens_per_image)[image]
        h, w = grid[image, 1], grid[image, 2]
        flat[0, tokens] = start + _temporal(offset // (h * w), seconds[image], rate[image])
        flat[1, tokens] = start + (offset // w) % h
        flat[2, tokens] = start + offset % w
    return positions.to(input_ids.dtype)


def split_video_frames(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """(V, 3) video grids -> (sum of t, 3): each video as t grids of one temporal patch (t = 1), as Qwen3-VL's
    get_rope_index splits them (transformers 5.19; vLLM and SGLang alike): its temporal patches are separated by
    their `<x.x seconds>` text, so each is laid out like an image, and with t = 1 the engines' rule for the text
    after it (largest position + 1) and transformers' (start + max(h, w)) agree.

    >>> split_video_frames(torch.tensor([[2, 4, 6], [1, 2, 2]])).tolist()
    [[1, 4, 6], [1, 4, 6], [1, 2, 2]]
    """
    grid = torch.as_tensor(video_grid_thw, dtype=torch.long).reshape(-1, 3)
    split = torch.repeat_interleave(grid, grid[:, 0], dim=0)
    split[:, 0] = 1
    return split


def _temporal(t_index: torch.Tensor, seconds: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """floor((t_index * seconds) * rate) in float32, in the order Qwen's original get_rope_index and SGLang multiply
    (transformers 5.19 multiplies seconds * rate first: the same for rate 2, every released Qwen2.5-VL's)."""
    return (t_index.to(torch.float32) * seconds * rate).long()


def _merged_grid(
    image_grid_thw: torch.Tensor | None,
    num_images: int,
    images_per_row: torch.Tensor,
    merge: int,
    device: torch.device,
    kind: str = "image",
) -> torch.Tensor:
    """(N, 3) merged grid (t, h // merge, w // merge), checked against the image (video) runs found in the ids."""
    given = 0 if image_grid_thw is None else int(image_grid_thw.shape[0])
    if given != num_images:
        rows_with_images = {i: int(n) for i, n in enumerate(images_per_row.tolist()) if n}
        raise ValueError(
            f"{kind}_grid_thw has {given} {kind}s but the ids hold {num_images} {kind} runs "
            f"({kind}s per batch row: {rows_with_images})"
        )
    if num_images == 0:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    grid = image_grid_thw.to(device=device, dtype=torch.long)
    return torch.stack([grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge], dim=1)


def _check_image_lengths(is_image: torch.Tensor, run_start: torch.Tensor, tokens_per_image: torch.Tensor) -> None:
    """Each run of image tokens must be exactly one image's t*h*w tokens: a prompt cut through an image would
    otherwise pair image features with the wrong tokens, silently."""
    if tokens_per_image.numel() == 0:
        return
    run_id = torch.cumsum(run_start.flatten().long(), 0) - 1
    lengths = torch.bincount(run_id[is_image.flatten()], minlength=tokens_per_image.numel())
    bad = (lengths != tokens_per_image).nonzero(as_tuple=True)[0]
    if bad.numel():
        k = int(bad[0])
        row = int((run_start.flatten().nonzero(as_tuple=True)[0][k]) // run_start.shape[1])
        raise ValueError(
            f"batch row {row}: image {k} has {int(lengths[k])} image tokens but its grid needs "
            f"{int(tokens_per_image[k])} (image_grid_thw does not match the ids)"
        )
