"""Plain-PyTorch stand-ins for the CPU kernels of sgl-kernel's `mamba` ops (CPU test harness only).

sglang 0.5.23 runs the Gated DeltaNet layers of Qwen3.5 (and Qwen3-Next, Kimi-Linear) on CPU through
`sgl_kernel.mamba` (causal conv1d and the chunked gated delta rule) and two ops it looks up as
`torch.ops.sgl_kernel.*` (the gating and the one-token recurrent update). Only the CPU build of sgl-kernel has them.
vLLM's CPU build carries the same kernels under `torch.ops._C` with the same schemas; these are their semantics,
written as transformers' PyTorch fallbacks compute them (`causal_conv1d_fn`, `torch_recurrent_gated_delta_rule`):

  causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                        silu_activation, pad_slot_id, is_weight_packed) -> (dim, T)
      x (dim, T) is the transpose of a contiguous (T, dim) tensor (the kernel refuses anything else); sequence i is
      columns query_start_loc[i]:query_start_loc[i+1], convolved causally (weight (dim, width), depthwise) after the
      width-1 columns conv_states[cache_indices[i]] when has_initial_state[i], else after zeros; its last width-1
      inputs are written back into that slot.
  causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, num_accepted_tokens,
                           conv_state_indices, pad_slot_id, is_weight_packed) -> (n, dim)
      one token per row: the slot's window, shifted by the token, convolved; the window written back.
  fused_gdn_gating_cpu(A_log, a, b, dt_bias) -> (g, beta), both (1, T, HV)
      g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b) (b's dtype).
  chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens,
                             head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps) -> (out, state)
      q, k (1, T, HK, D_k), v (1, T, HV, D_v), HV a multiple of HK (value head h reads key head h // (HV / HK));
      each sequence of cu_seqlens starts from initial_state[initial_state_indices[i]] (laid out (HV, D_k, D_v))
      and leaves its final state there; out (1, T, HV, D_v) in v's dtype, state = initial_state.
  fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                             initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                             softplus_beta, softplus_threshold) -> (n, 1, HV, D_v)
      the gating (beta rounded to b's dtype, as fused_gdn_gating_cpu gives it) and one step of the delta rule for
      n one-token sequences, states updated in place.

State arithmetic is float32, as in the kernels. On a CPU without AMX sglang never packs the conv weights (it packs
them only where AMX is), so `is_weight_packed` is accepted and the weight read as the plain (dim, width) matrix.
tests/cpu_test_harness/test_sgl_kernel_mamba.py checks each op against transformers' fallback and vLLM's op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")


def _op(schema: str):
    """Define `torch.ops.sgl_kernel.<name>` from `schema` with the decorated function as its CPU implementation."""

    def register(fn):
        name = schema.split("(", 1)[0]
        _lib.define(schema)
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of states.

    state (n, HV, Dk, Dv); q, k (n, HV, Dk) (q already normalised and scaled); v (n, HV, Dv); g, beta (n, HV).
    Returns (new state, output (n, HV, Dv)), float32."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # (n, HV, Dv): what the state predicts for this key
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


def _heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, normalise: bool, eps: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., HK, Dk) query and key -> (..., HV, Dk) float32: each key head serves HV / HK value heads in a row;
    optionally L2-normalised; the query scaled by Dk ** -0.5."""
    q, k = q.float(), k.float()
    if normalise:
        q, k = _l2norm(q, eps), _l2norm(k, eps)
    repeat = num_v_heads // q.shape[-2]
    q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def _state_view(state: torch.Tensor, num_v_heads: int, key_dim: int, value_dim: int) -> torch.Tensor:
    """The state pool as (slots, HV, Dk, Dv), the kernels' memory layout whatever the pool's declared shape."""
    return state.view(state.shape[0], num_v_heads, key_dim, value_dim)


@_op("causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, Tensor? query_start_loc, "
     "Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, int pad_slot_id, bool is_weight_packed)"
     " -> Tensor")
def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                          silu_activation, pad_slot_id, is_weight_packed):
    if x.dim() != 2 or x.stride(0) != 1:
        raise RuntimeError("causal_conv1d_fwd_cpu: expect x to be transposed.")
    dim, total = x.shape
    weight = weight.reshape(dim, -1).float()
    width = weight.shape[1]
    out = torch.empty(total, dim, dtype=x.dtype).t()
    bounds = [0, total] if query_start_loc is None else [int(i) for i in query_start_loc.tolist()]
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        slot = i if cache_indices is None else int(cache_indices[i])
        if end == start or slot == pad_slot_id:
            continue
        resume = conv_states is not None and has_initial_state is not None and bool(has_initial_state[i])
        window = conv_states[slot].float() if resume else torch.zeros(dim, width - 1)
        inputs = torch.cat([window, x[:, start:end].float()], dim=-1)  # (dim, width - 1 + L)
        y = F.conv1d(inputs[None], weight[:, None], None if bias is None else bias.float(), groups=dim)[0]
        out[:, start:end] = (F.silu(y) if silu_activation else y).to(x.dtype)
        if conv_states is not None:
            conv_states[slot].copy_(inputs[:, -(width - 1):])
    return out


@_op("causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu_activation, "
     "Tensor? num_accepted_tokens, Tensor? conv_state_indices, int pad_slot_id, bool is_weight_packed) -> Tensor")
def causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, num_accepted_tokens, conv_state_indices,
                             pad_slot_id, is_weight_packed):
    if x.dim() != 2 or num_accepted_tokens is not None:
        raise NotImplementedError("causal_conv1d_update_cpu (CPU stand-in): one token per row, no speculative "
                                  "decoding")
    n, dim = x.shape
    weight = weight.reshape(dim, -1).float()
    slots = (torch.arange(n) if conv_state_indices is None else conv_state_indices.long())
    keep = slots != pad_slot_id
    out = torch.zeros_like(x)
    if not bool(keep.any()):
        return out
    slots = slots[keep]
    inputs = torch.cat([conv_states[slots].float(), x[keep].float()[..., None]], dim=-1)  # (n, dim, width)
    y = (inputs * weight).sum(dim=-1) + (0.0 if bias is None else bias.float())
    out[keep] = (F.silu(y) if silu_activation else y).to(x.dtype)
    conv_states[slots] = inputs[..., 1:].to(conv_states.dtype)
    return out


@_op("fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)")
def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g[None], torch.sigmoid(b.float()).to(b.dtype)[None]


@_op("chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
     "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
     "bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-05) -> (Tensor, Tensor)")
def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                               use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5):
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu (CPU stand-in): head_first=False only")
    num_v_heads, value_dim = value.shape[-2:]
    q, k = _heads(query[0], key[0], num_v_heads, use_qk_l2norm_in_kernel, eps)  # (T, HV, Dk)
    v, g, beta = value[0].float(), g[0].float(), beta[0].float()
    pool = _state_view(initial_state, num_v_heads, q.shape[-1], value_dim)
    out = torch.empty(value.shape[1], num_v_heads, value_dim)
    bounds = [int(i) for i in cu_seqlens.tolist()]
    # every sequence advances one token per step: max(length) steps for the whole batch
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    slots = initial_state_indices.long()
    state = pool[slots].float()  # (B, HV, Dk, Dv)
    for t in range(int(lengths.max()) if len(lengths) else 0):
        live = (lengths > t).nonzero().squeeze(1)
        pos = starts[live] + t
        new, o = _delta_rule_step(state[live], q[pos], k[pos], v[pos], g[pos], beta[pos])
        state[live] = new
        out[pos] = o
    pool[slots] = state.to(pool.dtype)
    return out[None].to(value.dtype), initial_state


@_op("fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, "
     "Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
     "bool use_qk_l2norm_in_kernel, float softplus_beta=1., float softplus_threshold=20.) -> Tensor")
def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    n = initial_state_indices.shape[0]
    if not bool((cu_seqlens.diff() == 1).all()) or q.shape[1] != n:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu (CPU stand-in): one token per "
                                  "sequence (decode) only")
    num_v_heads, value_dim = v.shape[-2:]
    qh, kh = _heads(q[0], k[0], num_v_heads, use_qk_l2norm_in_kernel, 1e-6)  # (n, HV, Dk)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                          threshold=softplus_threshold)
    beta = torch.sigmoid(b.float()).to(b.dtype).float()  # in b's dtype, as the gating op gives it to a prefill
    pool = _state_view(initial_state_source, num_v_heads, qh.shape[-1], value_dim)
    slots = initial_state_indices.long()
    live = slots >= 0  # padded entries carry a negative slot
    out = torch.zeros(n, 1, num_v_heads, value_dim, dtype=v.dtype)
    if bool(live.any()):
        state, o = _delta_rule_step(pool[slots[live]].float(), qh[live], kh[live], v[0][live].float(), g[live],
                                    beta[live])
        pool[slots[live]] = state.to(pool.dtype)
        out[live] = o[:, None].to(v.dtype)
    return out


# ---------------------------------------------------------------------------------------------------- the Python API
# What sglang imports (`from sgl_kernel.mamba import ...`), with the call signatures of sglang 0.5.23's call sites.


def causal_conv1d_fn_cpu(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu):
    return torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(mixed_qkv_transposed, conv_weights, bias, conv_states,
                                                      query_start_loc, cache_indices, has_initial_state,
                                                      activation == "silu", -1, True)


def causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
                             intermediate_conv_window=None, intermediate_state_indices=None, retrieve_next_token=None,
                             retrieve_next_sibling=None, retrieve_parent_token=None):
    if intermediate_conv_window is not None:
        raise NotImplementedError("causal_conv1d_update_cpu (CPU stand-in): no speculative target verify")
    return torch.ops.sgl_kernel.causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias,
                                                         activation == "silu", None, conv_state_indices, -1, True)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices):
    out, state = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, True, cu_seqlens,
                                                                 head_first, use_qk_l2norm_in_kernel,
                                                                 initial_state_indices)
    return out, state, None  # (output, final states, per-chunk states: not kept)
