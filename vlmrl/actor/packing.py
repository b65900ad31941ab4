"""Row boundaries for the linear-attention layers of a packed forward (actor.padding_free).

A packed micro-batch lays its rows one after another in one (1, T) sequence (`vlmrl.actor.forward.packed_micro_batch`)
and tells transformers where each row starts through the text-position row of its position ids, which restarts at
0. Attention layers read that and attend within each row. A linear-attention layer (Qwen3.5's Gated DeltaNet) does
not: its causal convolution and its recurrent state run straight across the sequence, so each row would start from
the state the previous row left (transformers 5.19's PyTorch fallbacks take no boundaries at all; the fused
kernels want `cu_seqlens` / `seq_idx` that nothing passes them: slime and prime-rl hit this, verl turns packing off
for Qwen3.5).

`add_row_boundaries(model)` gives those layers the boundaries: each decoder layer holding a linear-attention mixer
(the family's `linear_attention` attribute) reads the row lengths from the text positions it is called with, and its
mixer then runs the rows as a right-padded (rows, longest row) batch, whose padding only follows each row's tokens
and so changes none of them, and packs the outputs back. Every other layer, and every forward that is not packed,
runs unchanged. The boundaries come from the layer's own inputs, so a recomputation under gradient checkpointing or
an FSDP2-sharded layer sees them too; the layers change class (not a bound closure), so a deep copy (the KL
reference) keeps its own weights.
"""

from __future__ import annotations

import contextvars
import logging

import torch

logger = logging.getLogger(__name__)

_ROW_LENGTHS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("vlmrl_packed_row_lengths",
                                                                                default=None)
"""The row lengths of the packed sequence the current decoder layer runs on (None: not packed)."""


def packed_row_lengths(text_positions: torch.Tensor | None) -> list[int] | None:
    """Row lengths of a packed (1, T) sequence from its text positions, which start a row wherever they do not step by
    1 (transformers' rule for packed sequences); None when there is one row or no such positions.

    >>> packed_row_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    [3, 2, 4]
    >>> packed_row_lengths(torch.tensor([[0, 1, 2]])) is None
    True
    """
    if text_positions is None or text_positions.dim() != 2 or text_positions.shape[0] != 1:
        return None
    positions = text_positions[0]
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=positions.device),
                        ((positions[1:] - positions[:-1]) != 1).nonzero().squeeze(1) + 1])
    if starts.numel() == 1:
        return None
    bounds = torch.cat([starts, torch.tensor([positions.numel()], device=positions.device)])
    return (bounds[1:] - bounds[:-1]).tolist()


class _PackedRowsLayer:
    """Mixed into a decoder layer with a linear-attention mixer: its forward publishes the packed row lengths."""

    def forward(self, *args, **kwargs):
        token = _ROW_LENGTHS.set(packed_row_lengths(kwargs.get("position_ids")))
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ROW_LENGTHS.reset(token)


class _PerRowMixer:
    """Mixed into a linear-attention mixer: on a packed sequence it runs each row as its own sequence."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        lengths = _ROW_LENGTHS.get()
        if lengths is None:
            return super().forward(hidden_states, *args, **kwargs)
        if args or kwargs.get("cache_params") is not None:
            raise RuntimeError("a packed forward runs without a cache (use_cache=False)")
        kwargs.pop("attention_mask", None)  # None on a packed sequence; the rows' padding below is at their ends
        rows = torch.split(hidden_states[0], lengths)  # each (n_i, H)
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (rows, longest, H), right-padded
        out = super().forward(padded, **kwargs)  # (rows, longest, H)
        return torch.cat([out[i, :n] for i, n in enumerate(lengths)])[None]  # (1, T, H)


_CLASSES: dict[tuple[type, type], type] = {}


def _with(mixin: type, module: torch.nn.Module) -> None:
    """Give `module` the class `mixin` + its own class (one such class per pair, so that copies and pickles agree)."""
    base = type(module)
    if issubclass(base, mixin):
        return
    key = (mixin, base)
    if key not in _CLASSES:
        _CLASSES[key] = type(base.__name__, (mixin, base), {"__module__": base.__module__,
                                                            "__qualname__": base.__qualname__})
    module.__class__ = _CLASSES[key]


def add_row_boundaries(model: torch.nn.Module) -> int:
    """Make every linear-attention layer of `model` (its family's, vlmrl.models.families) keep the rows of a packed
    forward apart; returns how many layers that is (0 for a family without linear attention)."""
    from vlmrl.models.families import family_of

    attribute = family_of(model.config).weights.linear_attention
    if attribute is None:
        return 0
    layers = [m for m in model.modules() if isinstance(getattr(m, attribute, None), torch.nn.Module)]
    for layer in layers:
        _with(_PackedRowsLayer, layer)
        _with(_PerRowMixer, getattr(layer, attribute))
    logger.debug("packed forwards keep rows apart in %d linear-attention layers", len(layers))
    return len(layers)
