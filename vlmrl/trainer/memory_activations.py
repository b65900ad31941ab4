"""The activation memory of one micro-batch's forward and backward, counted from the tensors the layers keep for
their backward: pure arithmetic over a model's widths (`vlmrl.trainer.memory_model`), no torch.

Two figures come out, a lower and an upper bound, and the memory plan reports the upper one:

- with gradient checkpointing (transformers checkpoints every decoder layer and vision block) every layer's input
  is kept (`stored`: layers x tokens x hidden); a layer's backward recomputes its forward, keeping that layer's
  saved tensors (`working`: one layer's, counted below), then makes their gradients, which are at most as large.
  So the peak lies between stored + working and stored + 2 x working;
- without it every layer keeps its saved tensors until its backward: layers x working, plus at most one layer's
  gradients on top;
- under autocast with float32 master weights (bfloat16 compute on a GPU) the forward casts every weight that
  requires grad to bfloat16 and keeps the copy (autocast's cast cache, or the graph) until the forward ends: 2 bytes
  x every trainable parameter, the whole model and not a shard, beside the stored inputs;
- what the peak adds either way: the final norm and the logits of one `actor.logprob_chunk_size` chunk (counted in
  the upper bound only: the head's backward runs before the layers', not with them), the attention mask of a padded
  or packed micro-batch (dense: rows x length^2 or tokens^2 bytes for sdpa), the vision tower's (its stored block
  inputs, its pixels and merged outputs).

A layer's saved tensors, per token, besides its input (H hidden, q = heads x head_dim, kv its KV width, I the MLP
width, b the bytes of the residual stream s / the compute dtype c; counted from what torch's autograd saves for
these layers in transformers 5.19, measured with saved-tensor hooks on the embedded models):
- each RMSNorm a float32 copy inside (4 H); without autocast also its output, and in a 16-bit stream the downcast
  copy its weight multiplies (b_s H each); the residual between attention and MLP (b_s H);
- attention: q, k, v after the rotary and the attention output (2 q + 2 kv in b_c; k and v expanded to q's heads
  by repeat_kv when a mask is passed, as in a padded micro-batch); Qwen3's per-head q/k norms two norms more;
- a dense SwiGLU MLP: gate, up, act(gate), their product: 4 I in b_c (a plain fc1/fc2 MLP: 2 I);
- a MoE MLP (transformers' grouped experts): each token's top-k copies in and out (3 k H) and their gate/up/act/
  product (4 k I_expert), the router's float32 logits and softmax (8 E bytes), a shared expert's 4 I_shared;
- a linear-attention (Gated DeltaNet) mixer: its projections, the causal convolution's input and output, the
  normalised q/k and the gated norm: 3 (2 K + V) + 6 V + 2 K in b_c (K, V: key and value widths) - estimated the
  same way, not measured (no embedded Qwen3.5 run measures it);
- under autocast, each linear's own bfloat16 copy of its input (q, k, v, gate and up: 5 H in b_c), and no float32
  output of the norms (the casts are kept instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.trainer.memory_model import TextShape, VisionShape

FLOAT32 = 4


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's shape, as the plan assumes it (the worst the config allows) or as a test measures it."""

    rows: int
    length: int
    """Tokens per row (padded: the longest row's; packed: the rows' average)."""
    response_tokens: int
    """Response tokens of all rows (what the logprob head projects)."""
    image_tokens: int
    """Language-model tokens of the images in the micro-batch (each row's own encoding: no sharing assumed)."""
    packed: bool = False
    """actor.padding_free: one sequence, a block-diagonal mask of tokens^2."""
    masked: bool = True
    """A padded micro-batch whose rows differ in length: sdpa gets a dense (rows, 1, length, length) mask."""

    @property
    def tokens(self) -> int:
        return self.rows * self.length


@dataclass(frozen=True)
class Precision:
    stream: int
    """Bytes of the residual stream: the master weights' dtype (the embedding output keeps it; autocast's bfloat16
    linear outputs add back into it)."""
    compute: int
    """Bytes of the linear layers' outputs: the compute dtype under autocast, else the master dtype."""

    @property
    def autocast(self) -> bool:
        return self.compute < self.stream


@dataclass(frozen=True)
class Activations:
    lower: int
    upper: int
    """What the plan reports."""
    parts: dict[str, int]
    """The upper bound's terms, for the table and the docs."""


def norm_bytes(width: int, stream: int, autocast: bool) -> int:
    """One RMSNorm's saved tensors per token, on an input of `stream` bytes (see the module docstring)."""
    if autocast:
        return FLOAT32 * width
    return FLOAT32 * width + stream * width + (stream * width if stream < FLOAT32 else 0)


def text_layer_bytes(text: TextShape, p: Precision, attention: bool, moe: bool, expand_kv: bool = True) -> int:
    """Bytes one decoder layer keeps for its backward, per token, besides its input (see the module docstring).
    `expand_kv`: a mask is passed, so sdpa gets k and v repeated to every query head."""
    h = text.hidden
    out = 2 * norm_bytes(h, p.stream, p.autocast) + h * p.stream + (5 * h * p.compute if p.autocast else 0)
    if attention:
        q = text.heads * text.head_dim
        kv = q if expand_kv else text.kv_heads * text.head_dim
        out += (2 * q + 2 * kv) * p.compute
        if text.qk_norm:
            out += norm_bytes(q, p.compute, False) + norm_bytes(kv, p.compute, False)
    else:
        k = text.linear_key_heads * text.linear_key_dim
        v = text.linear_value_heads * text.linear_value_dim
        out += (3 * (2 * k + v) + 6 * v + 2 * k) * p.compute
    if moe:
        out += (3 * text.top_k * h + 4 * text.top_k * text.expert_intermediate) * p.compute + 2 * FLOAT32 * text.experts
        out += 4 * text.shared_expert_intermediate * p.compute
    else:
        out += 4 * text.intermediate * p.compute
    return out


def layer_kinds(text: TextShape) -> dict[tuple[bool, bool], int]:
    """How many decoder layers of each (attention, moe) kind. Where the counts do not pin the pairing down (a model
    with both linear-attention and dense layers), the larger kinds are paired: the plan's layers are never smaller
    than the model's."""
    attention, moe, layers = text.attention_layers, text.moe_layers, text.layers
    both = min(attention, moe)
    kinds = {(True, True): both, (True, False): attention - both, (False, True): moe - both,
             (False, False): layers - attention - (moe - both)}
    return {kind: count for kind, count in kinds.items() if count > 0}


def vision_block_bytes(vision: VisionShape, p: Precision) -> int:
    """Bytes one vision block keeps for its backward, per patch (norms, attention as the text's, the MLP)."""
    h = vision.hidden
    mlp = (4 if vision.gated_mlp else 2) * vision.intermediate
    return (2 * norm_bytes(h, p.stream, p.autocast) + h * p.stream + (5 * h * p.compute if p.autocast else 0)
            + 4 * h * p.compute + mlp * p.compute)


def activation_bytes(text: TextShape, vision: VisionShape | None, mb: MicroBatch, p: Precision, checkpointing: bool,
                     chunk: int, trainable_forward: int, block_trainable: int, vision_trains: bool) -> Activations:
    """The activation memory of one micro-batch's forward and backward (see the module docstring).

    Args:
        trainable_forward: parameters the forward casts and keeps under autocast (those that require grad).
        block_trainable: the largest decoder layer's trainable parameters (its casts live through its backward).
        vision_trains: the tower's weights train (else its forward keeps nothing for a backward).
    """
    t, h = mb.tokens, text.hidden
    kinds = layer_kinds(text)
    working = max(text_layer_bytes(text, p, *kind, expand_kv=mb.masked or mb.packed) for kind in kinds) * t
    if checkpointing:
        stored = text.layers * t * h * p.stream
        saved_layers = 0
    else:
        stored = 0
        saved_layers = sum(count * (text_layer_bytes(text, p, *kind, expand_kv=mb.masked or mb.packed) + h * p.stream)
                           for kind, count in kinds.items()) * t  # every layer's input too
    cache = 2 * trainable_forward if p.autocast else 0
    layer_casts = 2 * block_trainable if p.autocast and checkpointing else 0
    tail = 3 * t * h * p.stream + 2 * t * text.head_dim * FLOAT32  # final norm in/out, rotary cos/sin
    mask = (mb.tokens ** 2 if mb.packed else mb.rows * mb.length ** 2 if mb.masked else 0)
    projected = min(chunk, mb.response_tokens) if chunk > 0 else mb.response_tokens
    head = 4 * projected * text.vocab * FLOAT32  # logits, log-softmax, softmax (entropy) and their gradient
    v_stored = v_working = v_io = 0
    if vision is not None and mb.image_tokens:
        patches = mb.image_tokens * vision.patches_per_token
        block = vision_block_bytes(vision, p) * patches
        v_io = patches * vision.patch_values * p.stream + vision.mergers * mb.image_tokens * h * p.compute
        if vision_trains:
            v_stored = vision.depth * patches * vision.hidden * p.stream if checkpointing else vision.depth * block
            v_working = 2 * block if checkpointing else block
        else:
            v_working = block  # a forward without a graph: one block's intermediates at a time
    kept = (stored if checkpointing else saved_layers) + v_stored
    if checkpointing:  # the forward's end (every cast kept) or a layer's backward (its recompute and gradients)
        low_extra, high_extra = max(cache, working + layer_casts), max(cache, 2 * working + layer_casts)
    else:
        low_extra, high_extra = cache, cache + working
    fixed = tail + mask + v_io
    parts = {"kept for the backward": kept, "peak of the backward": high_extra, "logits chunk": head,
             "vision tower": v_io + v_working, "mask": mask, "final norm and rotary": tail,
             "of which autocast weight copies": cache}
    return Activations(lower=kept + low_extra + fixed, upper=kept + high_extra + fixed + head + v_working,
                       parts=parts)


def forward_bytes(text: TextShape, vision: VisionShape | None, mb: MicroBatch, p: Precision, chunk: int) -> int:
    """A no-grad forward (the old and reference logprob passes): one layer's intermediates at a time, the layer's
    input and output, the mask, the head's chunk (logits and log-softmax), the vision tower one block at a time."""
    t = mb.tokens
    layer = max(text_layer_bytes(text, p, *kind) for kind in layer_kinds(text)) * t
    projected = min(chunk, mb.response_tokens) if chunk > 0 else mb.response_tokens
    mask = (mb.tokens ** 2 if mb.packed else mb.rows * mb.length ** 2 if mb.masked else 0)
    out = layer + 2 * t * text.hidden * p.stream + mask + 2 * projected * text.vocab * FLOAT32
    if vision is not None and mb.image_tokens:
        out += vision_block_bytes(vision, p) * mb.image_tokens * vision.patches_per_token
    return out
