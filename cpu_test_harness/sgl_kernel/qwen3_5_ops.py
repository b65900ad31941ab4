"""Plain-PyTorch stand-ins for the non-mamba CPU ops sglang 0.5.23's Qwen3.5 model calls (CPU test harness only).

sglang's `models/qwen3_5.py` binds these `torch.ops.sgl_kernel.*_cpu` ops when it runs on CPU and calls them on every
forward, AMX or not. Their semantics are those of the model code they replace, as transformers' Qwen3.5 computes it
(roundings included, so that the engine stays as close to the trainer as its bfloat16 allows):

  fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v)
      mixed_qkvz = [all q | all k | all v | all z], mixed_ba = [all b | all a] (one row per token) ->
      (mixed_qkv [q | k | v], z (T, HV, Dv), b (T, HV), a (T, HV)), each contiguous.
  fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim) -> (q (T*H, D), k (T*HKV, D))
      per-head RMS norm with the zero-centred weight (x / rms * (1 + w)), computed in float32.
  fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads) -> (q, k, gate)
      q_gate holds [q_h, gate_h] per head; q and k normalised as above, the gate split out, (T*H, D) each.
  fused_sigmoid_mul_cpu(x, gate) -> x
      x *= sigmoid(gate), in place (the full-attention output gate).
  fused_rmsnorm_gated_cpu(x, weight, z, eps) -> (T, D)
      the linear-attention output norm: RMS norm (float32, rounded to x's dtype), times weight, times silu(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kernel.mamba import _op


def _gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    rows = x.reshape(-1, head_dim).float()
    normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


@_op("fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
     "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)")
def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    qk, v = num_heads_qk * head_qk, num_heads_v * head_v
    query, key, value, z = mixed_qkvz.split([qk, qk, v, v], dim=-1)
    b, a = mixed_ba.split([num_heads_v, num_heads_v], dim=-1)
    mixed_qkv = torch.cat([query, key, value], dim=-1)
    return mixed_qkv, z.reshape(-1, num_heads_v, head_v).contiguous(), b.contiguous(), a.contiguous()


@_op("fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) "
     "-> (Tensor, Tensor)")
def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim):
    return _gemma_rms(q, q_weight, eps, head_dim), _gemma_rms(k, k_weight, eps, head_dim)


@_op("fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
     "int head_dim, int num_heads) -> (Tensor, Tensor, Tensor)")
def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads):
    q, gate = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim).split(head_dim, dim=-1)
    return (_gemma_rms(q, q_weight, eps, head_dim), _gemma_rms(k, k_weight, eps, head_dim),
            gate.reshape(-1, head_dim).contiguous())


@_op("fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> Tensor")
def fused_sigmoid_mul_cpu(x, gate):
    # transformers: attn_output * torch.sigmoid(gate), both in the activations' dtype
    x.copy_((x * torch.sigmoid(gate.reshape(x.shape))).to(x.dtype))
    return x


@_op("fused_rmsnorm_gated_cpu(Tensor x, Tensor weight, Tensor z, float eps) -> Tensor")
def fused_rmsnorm_gated_cpu(x, weight, z, eps):
    # transformers' Qwen3_5RMSNormGated: the norm in float32 rounded to x's dtype, times the weight, times silu(z)
    rows = x.float()
    normed = (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(x.dtype)
