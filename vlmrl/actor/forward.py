"""One micro-batch's tensors and the forward that gives its response tokens' logprobs: the rows of a `TrainBatch` cut
to what they attend (or packed one after another), and the model run with a head that computes the response's
logprobs and entropy chunk by chunk instead of the full-vocabulary logits. `vlmrl.actor.core.ActorCore`'s logprob
pass and update run every micro-batch through `forward_response`; the compare tool's drill-down and the benchmarks
call it directly.

Every forward gets EXPLICIT 3D position ids (`TrainBatch.mrope_position_ids()`, computed by the processor): without
them transformers silently falls back to 1-D positions and logprobs drift by up to a nat.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vlmrl.algorithms.logprobs import logprobs_and_entropy, top_logprobs
from vlmrl.models.families import family_of
from vlmrl.types import TrainBatch


@dataclass
class MicroBatch:
    """Model inputs for some rows of a TrainBatch: a padded (b, l) block with all-padding columns trimmed (positions
    are explicit, so dropping columns that no row attends changes nothing but the cost), or, packed, the rows'
    tokens one after another in a (1, T) sequence without any padding."""

    rows: list[int]
    input_ids: torch.Tensor
    """(b, l) long; packed: (1, T), T the rows' summed lengths."""
    attention_mask: torch.Tensor | None
    """(b, l) long; packed: None (attention stays within each row through the position ids)."""
    position_ids: torch.Tensor
    """(3, b, l) long: the layout the HF forward takes; packed: (4, 1, T), row 0 each row's own 0..len-1 text
    positions (transformers starts a new sequence wherever they do not step by 1), rows 1-3 the mrope ids."""
    response_width: int
    """r: the (trimmed) response width; padded: the last r columns are the response."""
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    video_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """pixel_values_videos, video_grid_thw, second_per_grid_ts of the rows with videos; empty without."""
    response_index: torch.Tensor | None = None
    """Packed: (N,) positions of the sequence whose next token is a response token (row by row)."""
    response_lengths: list[int] | None = None
    """Packed: response tokens of each row (N = their sum)."""
    token_lengths: list[int] = field(default_factory=list)
    """Each row's attended tokens (prompt + response) in the forward, in row order (MoE routing is kept per row)."""

    def attended(self) -> torch.Tensor:
        """The forward's flattened token mask: which of its tokens are a row's own (padding ones are not)."""
        if self.attention_mask is None:
            return torch.ones(self.input_ids.numel(), dtype=torch.bool, device=self.input_ids.device)
        return self.attention_mask.reshape(-1).bool()


def _vision_inputs(batch: TrainBatch, rows: Sequence[int], device: torch.device
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The rows' pixel values and grids, and their video inputs (pixel_values_videos, video_grid_thw,
    second_per_grid_ts), each concatenated in row order (the order of their image / video tokens)."""
    mm = [batch.multi_modal_inputs[i] for i in rows if batch.multi_modal_inputs[i]]
    with_images = [m for m in mm if "pixel_values" in m]
    pixel_values = torch.cat([m["pixel_values"] for m in with_images]).to(device) if with_images else None
    grid = torch.cat([m["image_grid_thw"] for m in with_images]).to(device) if with_images else None
    with_videos = [m for m in mm if "pixel_values_videos" in m]
    video_inputs = {key: torch.cat([m[key] for m in with_videos]).to(device)  # Qwen3-VL: no second_per_grid_ts
                    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
                    if with_videos and key in with_videos[0]}
    return pixel_values, grid, video_inputs


def micro_batch(batch: TrainBatch, rows: Sequence[int], device: torch.device, packed: bool = False) -> MicroBatch:
    if packed:
        return packed_micro_batch(batch, rows, device)
    index = torch.as_tensor(list(rows), dtype=torch.long)
    attention = batch.attention_mask[index]
    prompt_len = batch.prompt_length
    attended_prompt = attention[:, :prompt_len].any(dim=0).nonzero()
    start = int(attended_prompt[0]) if len(attended_prompt) else prompt_len - 1
    attended_response = attention[:, prompt_len:].any(dim=0).nonzero()
    width = int(attended_response[-1]) + 1 if len(attended_response) else 1
    columns = slice(start, prompt_len + width)
    pixel_values, grid, video_inputs = _vision_inputs(batch, rows, device)
    return MicroBatch(
        rows=list(rows),
        input_ids=batch.input_ids[index, columns].to(device),
        attention_mask=attention[:, columns].to(device),
        position_ids=batch.position_ids[index][:, :, columns].permute(1, 0, 2).contiguous().to(device),
        response_width=width,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        video_inputs=video_inputs,
        token_lengths=attention[:, columns].sum(dim=1).tolist(),
    )


def packed_micro_batch(batch: TrainBatch, rows: Sequence[int], device: torch.device) -> MicroBatch:
    """The rows' attended tokens concatenated (padding-free, actor.padding_free): row i's prompt and response
    columns [P - n_i, P + r_i), its own mrope ids, and a text-position row restarting at 0, from which transformers
    builds a block-diagonal causal mask (sdpa/eager) or varlen boundaries (flash-attention)."""
    p_len = batch.prompt_length
    ids, positions, text, index, lengths = [], [], [], [], []
    offset = 0
    for row in rows:
        n = int(batch.attention_mask[row, :p_len].sum())
        r = int(batch.attention_mask[row, p_len:].sum())
        columns = slice(p_len - n, p_len + r)
        ids.append(batch.input_ids[row, columns])
        positions.append(batch.position_ids[row][:, columns])
        text.append(torch.arange(n + r, dtype=torch.long))
        index.append(torch.arange(offset + n - 1, offset + n - 1 + r, dtype=torch.long))
        lengths.append(r)
        offset += n + r
    position_ids = torch.cat([torch.cat(text)[None], torch.cat(positions, dim=1)])[:, None, :]
    pixel_values, grid, video_inputs = _vision_inputs(batch, rows, device)
    return MicroBatch(
        rows=list(rows),
        input_ids=torch.cat(ids)[None].to(device),
        attention_mask=None,
        position_ids=position_ids.contiguous().to(device),
        response_width=max(max(lengths), 1),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        video_inputs=video_inputs,
        response_index=torch.cat(index).to(device),
        response_lengths=lengths,
        token_lengths=[len(t) for t in text],
    )


class _ResponseHead(torch.nn.Module):
    """Stands in for the model's lm_head during one forward: instead of the full-vocabulary logits of every kept
    position it computes the response's logprobs and entropy chunk by chunk (`logprobs_and_entropy`). It runs
    inside the model's own forward, so a sharded (FSDP2) model has its head's weight gathered, as for the lm_head."""

    def __init__(self, lm_head: torch.nn.Module, labels: torch.Tensor, temperature: float, chunk: int,
                 with_entropy: bool, entropy_grad: bool, drop_last: bool = True):
        super().__init__()
        self.lm_head = lm_head
        self.labels = labels
        self.drop_last = drop_last
        self.options = {"temperature": temperature, "chunk": chunk, "with_entropy": with_entropy,
                        "entropy_grad": entropy_grad}
        self.entropy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(b, r + 1, H) hidden states of positions P-1 .. L-1 -> (b, r) logprobs (the model returns them as its
        `logits`); packed (`drop_last` False): (1, N, H) of exactly the predicting positions -> (1, N). The entropy
        is kept in `self.entropy`."""
        hidden = hidden[:, :-1] if self.drop_last else hidden
        logprobs, self.entropy = logprobs_and_entropy(hidden, self.lm_head, self.labels, **self.options)
        return logprobs


@contextmanager
def _output_head(model: torch.nn.Module, head: torch.nn.Module):
    """The model with `head` as its output projection for the duration of the block."""
    lm_head = model.get_output_embeddings()
    model.set_output_embeddings(head)
    try:
        yield
    finally:
        model.set_output_embeddings(lm_head)


def forward_response(model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool,
                     entropy_grad: bool = False, chunk: int = 0, extra_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (b, r) of the response tokens under softmax(logits / temperature), and their entropy (b, r)
    (without a graph unless `entropy_grad`: a metric needs no backward). `chunk` > 0: the logits are made `chunk`
    tokens at a time and recomputed in the backward (actor.logprob_chunk_size), so the full (b, r, V) logits never
    exist; the values are the unchunked ones (float32 or the weights' wider precision, up to the projection's
    summation order). `extra_ids` (b, r, K): the logprobs of these ids at each response position too (a distillation
    teacher's top-k), in the same pass: the logprobs then come as (b, r, 1 + K), the response tokens' first."""
    packed = mb.response_index is not None
    if packed:
        labels = mb.input_ids[:, mb.response_index + 1]  # (1, N)
        keep = mb.response_index  # only the predicting positions reach the head
    else:
        labels = mb.input_ids[:, -mb.response_width :]
        keep = mb.response_width + 1  # positions P-1 .. L-2 predict the response tokens P .. L-1
    if extra_ids is not None:  # (b, r, K) -> labels (b, r, 1 + K); packed: the rows' own positions, one after another
        extra = (torch.cat([ids[:n] for ids, n in zip(extra_ids, mb.response_lengths)]).unsqueeze(0) if packed
                 else extra_ids)
        labels = torch.cat([labels.unsqueeze(-1), extra.to(labels.device)], dim=-1)
    head = _ResponseHead(model.get_output_embeddings(), labels, temperature, chunk, with_entropy, entropy_grad,
                         drop_last=not packed)
    with _output_head(model, head):
        out = model(**_model_inputs(model, mb), use_cache=False, logits_to_keep=keep)
    if not packed:
        return out.logits, head.entropy
    return (_unpack(out.logits[0], mb.response_lengths, mb.response_width),
            None if head.entropy is None else _unpack(head.entropy[0], mb.response_lengths, mb.response_width))


class _TopHead(torch.nn.Module):
    """Stands in for a frozen model's lm_head: the response tokens' logprobs (its `logits`) and, kept on it, the k
    largest logprobs at each position with their ids (`vlmrl.algorithms.logprobs.top_logprobs`)."""

    def __init__(self, lm_head: torch.nn.Module, labels: torch.Tensor, k: int, temperature: float, chunk: int,
                 drop_last: bool):
        super().__init__()
        self.lm_head, self.labels, self.k, self.drop_last = lm_head, labels, k, drop_last
        self.options = {"temperature": temperature, "chunk": chunk}
        self.top: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1] if self.drop_last else hidden
        logprobs, values, ids = top_logprobs(hidden, self.lm_head, self.labels, self.k, **self.options)
        self.top = values, ids
        return logprobs


@torch.no_grad()
def forward_top_logprobs(model: torch.nn.Module, mb: MicroBatch, k: int, temperature: float = 1.0, chunk: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frozen model's (b, r) logprobs of the response tokens and, at each response position, its k largest
    logprobs (b, r, k) with their ids (b, r, k), largest first; 0 (ids 0) after each row's response."""
    packed = mb.response_index is not None
    labels = mb.input_ids[:, mb.response_index + 1] if packed else mb.input_ids[:, -mb.response_width:]
    head = _TopHead(model.get_output_embeddings(), labels, k, temperature, chunk, drop_last=not packed)
    with _output_head(model, head):
        out = model(**_model_inputs(model, mb), use_cache=False,
                    logits_to_keep=mb.response_index if packed else mb.response_width + 1)
    values, ids = head.top
    if not packed:
        return out.logits, values, ids
    lengths, width = mb.response_lengths, mb.response_width
    return (_unpack(out.logits[0], lengths, width), _unpack(values[0], lengths, width),
            _unpack(ids[0], lengths, width))


def _model_inputs(model: torch.nn.Module, mb: MicroBatch) -> dict:
    """The model's forward inputs of a micro-batch: its ids, mask, explicit position ids and vision inputs in the
    weights' dtype (a 1-D family takes the first position row; tiles: no grid)."""
    dtype = next(model.parameters()).dtype
    pixel_values = mb.pixel_values.to(dtype) if mb.pixel_values is not None else None
    videos = {k: v.to(dtype) if k == "pixel_values_videos" else v for k, v in mb.video_inputs.items()}
    return family_of(model.config).inputs.forward_inputs(dict(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
        pixel_values=pixel_values, image_grid_thw=mb.image_grid_thw, **videos))


def _unpack(values: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """(N, ...) row-by-row response values -> (b, width, ...), zero-filled after each row's own length."""
    rows = torch.split(values, lengths)
    tail = (0, 0) * (values.dim() - 1)  # the trailing dimensions stay as they are
    return torch.stack([torch.nn.functional.pad(row, (*tail, 0, width - row.shape[0])) for row in rows])
