"""Run the vision tower in EVERY forward on every rank, so that sharded collectives line up even when a rank's rows
carry no image.

With FSDP2 every rank must run the same blocks in the same order; a micro-batch without an image would skip the tower
on its rank while another runs it, and gloo aborts or the group hangs (measured: skipping it, or running it without
using the output, fails). So the tower runs on a dummy image and the outputs of every merger the family names
(`WeightsLayout.vision_mergers`, Qwen3-VL's deepstack mergers included) are added to the input embeddings with weight 0:
numerically identical to the plain model (x + 0 == x), and the backward reaches every vision tensor on every rank.
The measurements: docs/distributed.md, "Why the vision tower runs on every rank"."""

from __future__ import annotations

import torch
from torch import nn

from vlmrl.models.families import family_of


class VisionAlwaysOn(nn.Module):
    """A Qwen-VL `...ForConditionalGeneration` (any family of vlmrl.models.families) whose forward always runs the
    vision tower once.

    Takes the same keyword arguments as the wrapped model and returns its output. With `pixel_values` it is the
    wrapped model's forward; without, the tower runs on a one-token dummy image (a 2x2 patch grid) first and the
    outputs of all its mergers reach the loss with weight 0.
    The wrapped model is `self.model`: state-dict names carry a `model.` prefix (see `WRAPPED_PREFIX`).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # paths, not modules: a module attribute would register the tower a second time (state-dict names twice)
        self.family = family_of(model.config)
        vision = model.config.vision_config
        if self.family.inputs.image_layout == "tiles":  # pixel_values rows are whole (C, S, S) tiles
            side = vision.image_size
            self.tile_shape = (int(vision.num_channels), *(int(x) for x in (side if isinstance(side, (list, tuple))
                                                                             else (side, side))))
            return
        self.merge = int(vision.spatial_merge_size)
        # pixel_values rows are flattened patches: channels x temporal patch x patch x patch
        self.patch_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)

    @property
    def config(self):
        return self.model.config

    # The actor swaps the output projection for a chunked logprob head during its forwards (vlmrl.actor.core); the
    # projection is the wrapped model's.
    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.model.set_output_embeddings(head)

    def forward(self, *, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, **kwargs):
        """input_ids (b, l); pixel_values (patches, patch_dim) and image_grid_thw (images, 3) or None; the rest
        (attention_mask, position_ids (3, b, l), use_cache, logits_to_keep...) is passed through."""
        grid = {} if image_grid_thw is None else {"image_grid_thw": image_grid_thw}  # tiles: no grid
        if pixel_values is not None or kwargs.get("pixel_values_videos") is not None:  # the tower runs anyway
            return self.model(input_ids=input_ids, pixel_values=pixel_values, **grid, **kwargs)
        from vlmrl.actor.lora import base_model_of

        if self.family.inputs.image_layout == "tiles":  # one dummy tile through the tower and the projector
            hf = base_model_of(self.model)
            tower = hf.get_submodule(self.family.weights.vision_tower)
            dummy = torch.zeros(1, *self.tile_shape, dtype=tower.dtype, device=input_ids.device)
            # the class's method: not the per-forward sharing wrapper, which would count the dummy as an image
            features = type(hf.model).get_image_features(hf.model, pixel_values=dummy, return_dict=True).pooler_output
            embeds = hf.get_input_embeddings()(input_ids) + 0.0 * features.sum()
            return self.model(input_ids=None, inputs_embeds=embeds, **kwargs)
        # run before the decoder, like a real image, so that every rank all-gathers blocks in the same order
        dummy_grid = torch.tensor([[1, self.merge, self.merge]], device=input_ids.device)
        hf = base_model_of(self.model)  # with LoRA the wrapped model is a PeftModel around the HF model
        tower = hf.get_submodule(self.family.weights.vision_tower)
        mergers = _merger_modules(tower, self.family.weights.vision_mergers)
        dummy = torch.zeros(self.merge * self.merge, self.patch_dim, dtype=tower.dtype, device=input_ids.device)
        outputs: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _args, out: outputs.append(out)) for m in mergers]
        try:
            tower(dummy, grid_thw=dummy_grid)
        finally:
            for hook in hooks:
                hook.remove()
        if len(outputs) != len(mergers):  # a merger the family names did not run: its gradient would be missing
            raise RuntimeError(f"{len(outputs)} of the {len(mergers)} vision mergers ran on the dummy image")
        zero = 0.0 * sum(out.sum() for out in outputs)
        embeds = hf.get_input_embeddings()(input_ids) + zero
        return self.model(input_ids=None, inputs_embeds=embeds, **kwargs)


def _merger_modules(tower: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """The merger modules at `paths` under the tower; a ModuleList (Qwen3-VL's deepstack mergers) gives its items."""
    out: list[nn.Module] = []
    for path in paths:
        module = tower.get_submodule(path)
        out.extend(module if isinstance(module, nn.ModuleList) else [module])
    return out


WRAPPED_PREFIX = "model."
"""State-dict names of a `VisionAlwaysOn` start with this; strip it to get the HF checkpoint names."""
