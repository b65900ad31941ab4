"""The vision tower once per distinct image (or video) of a forward, not once per row.

In GRPO every prompt is sampled n times, and each of its n rows carries the prompt's images. A micro-batch that holds
several rows of one group would run the tower n times on identical pixels. `shared_vision(model)` makes the model's
forwards encode each distinct image once: inside the block, the model's `get_image_features` /
`get_video_features` (transformers' hook between the pixels and the language model, the same in every family vlmrl
trains) groups the forward's images by content (the same patch grid and the same pixel values, compared exactly),
runs the tower on one of each, and hands every row the features of its image. Where an image's features feed several
rows, autograd sums their gradients into the one tower forward, as it does for any reused tensor; the tower's
per-image computation does not depend on the other images of the call (attention stays within an image or frame), so
logprobs and losses equal the per-row forward's, and so do the gradients, up to the summation order of the shared
features' gradients, but for the tower's own: transformers computes parts of the tower in float32 whatever the
model's dtype (Qwen2.5-VL's and GLM-4.1V's RMSNorm, the Qwen and GLM towers' rotary, GLM-4.1V's position-embedding
interpolation), and the backward of such a cast rounds to float32 the gradient flowing through it: the summed
gradient once here, each row's in the per-row forward. So in float64 the tower's gradients agree to float32
rounding and every other gradient to float64's (tests/actor/test_vision_share.py).

Everything stays inside the model's own forward, so a sharded (FSDP2) model gathers its tower's weights as it always
does, every rank still runs the tower once per forward, and the always-on wrapper's guarantee is untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

ENCODERS = ("get_image_features", "get_video_features")
"""transformers' per-family methods that run the vision tower on a forward's pixels (their outputs' `pooler_output`
is a tuple of per-image or per-video features, Qwen3-VL's `deepstack_features` a list of such tuples)."""


@dataclass
class VisionCounts:
    """How many images / videos the forwards inside the block carried and how many the tower encoded, and with
    `flops` (grids -> the tower's model FLOPs of encoding them: `vlmrl.models.flops.ModelFlops.vision_flops`) what
    those would cost and what was run."""

    flops: Callable[[list[list[int]]], float] | None = None
    items: int = 0
    encoded: int = 0
    flops_items: float = 0.0
    flops_encoded: float = 0.0

    def add(self, grids: list[list[int]], firsts: list[int]) -> None:
        self.items += len(grids)
        self.encoded += len(firsts)
        if self.flops is not None:
            self.flops_items += self.flops(grids)
            self.flops_encoded += self.flops([grids[i] for i in firsts])

    def take(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """The metrics since the last call ({} when no forward carried an image or video). `total`: sums the counts
        over the processes that share the update (FSDP ranks: a collective, so every rank calls this)."""
        counts = torch.tensor([self.items, self.encoded, self.flops_items / 1e12, self.flops_encoded / 1e12],
                              dtype=torch.float64)
        if total is not None:
            counts = total(counts)
        self.items = self.encoded = 0
        self.flops_items = self.flops_encoded = 0.0
        items, encoded, tflops, tflops_encoded = (float(c) for c in counts.cpu())
        if not items:
            return {}
        out = {"actor/vision_items": items, "actor/vision_items_encoded": encoded}
        if self.flops is not None:
            out.update({"actor/vision_tflops": tflops, "actor/vision_tflops_encoded": tflops_encoded})
        return out


_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], torch.nn.Module | None]] = \
    weakref.WeakKeyDictionary()
"""encoder_owner's answer per model, kept while the model lives (the owner by weak reference: it may be the model)."""


def encoder_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward calls `get_image_features` (transformers' `...Model` inside the
    `...ForConditionalGeneration`), through vlmrl's and PEFT's wrappers; None for a model without one. Found by a
    walk over the model's modules once per model, not on every micro-batch: a wrapper (PEFT's LoRA) is a model of
    its own, asked once more, and wrapping in place (FSDP2, PEFT's adapter layers) keeps the owner module."""
    if model not in _OWNERS:
        owner = next((module for module in model.modules() if callable(getattr(type(module), "get_image_features",
                      None)) and hasattr(module, "language_model") and not hasattr(module, "lm_head")), None)
        _OWNERS[model] = (lambda: None) if owner is None else weakref.ref(owner)
    return _OWNERS[model]()


@contextmanager
def shared_vision(model: torch.nn.Module, counts: VisionCounts | None = None, enabled: bool = True) -> Iterator[None]:
    """Within the block, `model`'s forwards encode each distinct image and video once (see the module docstring).
    `counts` adds up what they carried and encoded. `enabled=False`: the per-row forward, still counted."""
    owner = encoder_owner(model)
    if owner is None:
        yield
        return
    patched = []
    busy = [False]  # Qwen3-VL's get_video_features calls get_image_features: the inner call passes straight through
    for name in ENCODERS:
        original = getattr(owner, name, None)
        if original is None or name in vars(owner):  # absent, or already wrapped by an enclosing block
            continue
        setattr(owner, name, partial(_encode_distinct, original, counts, enabled, busy))
        patched.append(name)
    try:
        yield
    finally:
        for name in patched:
            delattr(owner, name)  # back to the class's method


def _encode_distinct(original: Callable, counts: VisionCounts | None, enabled: bool, busy: list[bool],
                     pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None, *args, **kwargs):
    """`original(pixel_values, grid_thw, ...)` on one of each distinct (grid, pixels) item, its per-item outputs
    handed back in the call's item order. Without a grid (a tiles family, InternVL: `pixel_values` (tiles, C, S,
    S), the tower's batch dimension), each tile is an item."""
    if grid_thw is None:
        return _encode_tiles(original, counts, enabled, pixel_values, *args, **kwargs)
    if busy[0]:
        return original(pixel_values, grid_thw, *args, **kwargs)
    busy[0] = True
    try:
        return _encode(original, counts, enabled, pixel_values, grid_thw, *args, **kwargs)
    finally:
        busy[0] = False


def _encode_tiles(original: Callable, counts: VisionCounts | None, enabled: bool, pixel_values: torch.Tensor,
                  *args, **kwargs):
    """Tiles: the tower runs on one of each distinct tile; its projected features (tiles, tokens, H) are indexed
    back into the call's tile order."""
    tiles = list(pixel_values)
    ones = torch.ones(len(tiles), 3, dtype=torch.long)
    if enabled:  # the tiles' sums in one reduction: one device sync for the whole call
        firsts, slot = distinct(tiles, ones, pixel_values.flatten(1).sum(dim=1).tolist())
    else:
        firsts, slot = list(range(len(tiles))), list(range(len(tiles)))
    if counts is not None:
        counts.add(ones.tolist(), firsts)
    if len(firsts) == len(tiles):
        return original(pixel_values=pixel_values, *args, **kwargs)
    out = original(pixel_values=pixel_values[firsts], *args, **kwargs)
    out.pooler_output = out.pooler_output[torch.tensor(slot, device=out.pooler_output.device)]
    return out


def _encode(original: Callable, counts: VisionCounts | None, enabled: bool, pixel_values: torch.Tensor,
            grid_thw: torch.Tensor, *args, **kwargs):
    sizes = [int(n) for n in grid_thw.prod(-1).tolist()]
    chunks = torch.split(pixel_values, sizes)
    firsts, slot = distinct(chunks, grid_thw) if enabled else (list(range(len(sizes))), list(range(len(sizes))))
    if counts is not None:
        counts.add([[int(x) for x in g] for g in grid_thw.tolist()], firsts)
    if len(firsts) == len(sizes):
        return original(pixel_values, grid_thw, *args, **kwargs)
    out = original(torch.cat([chunks[i] for i in firsts]), grid_thw[firsts], *args, **kwargs)
    out.pooler_output = tuple(out.pooler_output[s] for s in slot)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:  # Qwen3-VL: per deepstack layer, the same per-item split
        out.deepstack_features = [tuple(layer[s] for s in slot) for layer in deepstack]
    return out


def distinct(chunks: tuple[torch.Tensor, ...] | list[torch.Tensor], grid_thw: torch.Tensor,
             sums: list[float] | None = None) -> tuple[list[int], list[int]]:
    """(the index of the first item of each distinct (grid, pixels), each item's position among those firsts).
    Items are bucketed by grid and pixel sum (`sums`, or computed here), then compared exactly within a bucket:
    linear in the items for all-distinct ones (a GRPO micro-batch may carry hundreds of tiles)."""
    firsts: list[int] = []
    slot: list[int] = []
    grids = [tuple(g) for g in grid_thw.tolist()]
    if sums is None:
        sums = [float(chunk.sum()) for chunk in chunks]
    buckets: dict[tuple, list[int]] = {}
    for i, chunk in enumerate(chunks):
        bucket = buckets.setdefault((grids[i], sums[i]), [])
        for position in bucket:
            if torch.equal(chunks[firsts[position]], chunk):
                slot.append(position)
                break
        else:
            slot.append(len(firsts))
            bucket.append(len(firsts))
            firsts.append(i)
    return firsts, slot
