"""The CPU stand-in's mamba ops (cpu_test_harness/sgl_kernel/mamba.py), each against the two implementations it
stands in for: transformers' PyTorch fallback of the same computation (what the trainer runs) and vLLM's CPU kernel
of the same name and schema (`torch.ops._C.*`, the kernel sgl-kernel's CPU build shares). Inputs are bfloat16, as
the engines run Qwen3.5 on CPU, with the tiny Qwen3.5's sizes (1 key head, 2 value heads of 128, conv width 4) and
two sequences per call resuming from pool slots out of order.

Tolerances, relative to the largest reference value, from measurement (3 seeds):
  - the delta rule against transformers: outputs within their bfloat16 rounding (measured <= 2.9e-4, bound 2^-8),
    final states (float32 in both) within 1e-5 (measured <= 6.1e-7);
  - against vLLM's kernels: 2.5e-2 (measured <= 1.0e-2, on outputs and states): vLLM's kernel keeps intermediates in
    bfloat16 and sits as far from transformers (measured 1.0e-2) as from the stand-in;
  - the conv1d against transformers: 2^-5, since transformers convolves in the weight's dtype (bfloat16) and the
    kernels in float32; against vLLM: 2^-7 (its output rounding), windows equal. On a CPU without AVX-512 BF16 vLLM
    runs its PyTorch fallbacks instead of the native conv1d kernels, and the test compares with what vLLM runs there
    (the prefill fallback convolves in bfloat16 as transformers does: 2^-5).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import sgl_kernel  # noqa: F401 - the stand-in on the test path (the venv's .pth), registering torch.ops.sgl_kernel
from sgl_kernel import mamba

BF16 = torch.bfloat16
TO_TRANSFORMERS = 2 ** -8
TO_TRANSFORMERS_STATE = 1e-5
TO_VLLM = 2.5e-2
CONV_TO_TRANSFORMERS = 2 ** -5
CONV_TO_VLLM = 2 ** -7
T, HK, HV, DK, DV, DIM, WIDTH = 70, 1, 2, 128, 128, 512, 4
SEQ = torch.tensor([0, 30, T], dtype=torch.int32)  # two sequences of 30 and 40 tokens
SLOTS = torch.tensor([2, 0], dtype=torch.int32)  # their pool slots, out of order


def vllm_ops():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (run `make test`, which installs it)")
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

    return torch.ops._C


def has_native_conv() -> bool:
    """Whether this CPU's vLLM build has the native conv1d kernels. vLLM ships them in its AVX-512 builds and runs them
    only on CPUs with AVX-512 BF16 (or ARM bf16); elsewhere (an AVX2-only CPU) its Qwen3.5 layer runs its PyTorch
    fallbacks, `causal_conv1d_fn_cpu` and `causal_conv1d_update_cpu` (vllm/model_executor/layers/mamba/ops/cpu)."""
    ops = vllm_ops()
    return hasattr(ops, "causal_conv1d_fwd_cpu") and torch.cpu._is_avx512_bf16_supported()


def vllm_conv1d_fwd(x, weight, states, resume):
    """vLLM's prefill conv1d as vLLM runs it on this CPU, and the tolerance against it: the native kernel (float32
    inside, output rounding 2^-7) or the fallback (convolves in bfloat16 as transformers does, 2^-5)."""
    if has_native_conv():
        out = vllm_ops().causal_conv1d_fwd_cpu(x, weight, None, states, SEQ, SLOTS, resume, True, -1, False)
        return out, CONV_TO_VLLM
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    out = causal_conv1d_fn_cpu(x, weight, None, states, SEQ, cache_indices=SLOTS, has_initial_state=resume,
                               activation="silu")
    return out, CONV_TO_TRANSFORMERS


def vllm_conv1d_update(x, weight, states, slots):
    """vLLM's decode conv1d as vLLM runs it on this CPU (see vllm_conv1d_fwd)."""
    if has_native_conv():
        return vllm_ops().causal_conv1d_update_cpu(x, states, weight, None, True, None, slots, -1, False), CONV_TO_VLLM
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    # pad_slot_id -1 as in the native call: vLLM's default (its null block, 0) would skip the test's slot 0
    return causal_conv1d_update_cpu(x, states, weight, None, "silu", conv_state_indices=slots, pad_slot_id=-1), \
        CONV_TO_VLLM


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def randn(gen, *shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def close(actual, expected, rel, what):
    """max |actual - expected| <= rel * max |expected| (plus a floor for all-small tensors)."""
    err = (actual.float() - expected.float()).abs().max().item()
    bound = rel * max(expected.float().abs().max().item(), 1e-3)
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------------- gating


def test_gating_equals_the_gdn_layers_and_vllms(gen):
    A_log, dt = torch.randn(HV, generator=gen), randn(gen, HV)
    a, b = randn(gen, T, HV, scale=3.0), randn(gen, T, HV, scale=3.0)
    g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt)
    # transformers' Qwen3_5GatedDeltaNet.forward: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    assert g.shape == beta.shape == (1, T, HV) and g.dtype == torch.float32 and beta.dtype == BF16
    torch.testing.assert_close(g[0], -A_log.float().exp() * F.softplus(a.float() + dt.float()))
    torch.testing.assert_close(beta[0], b.sigmoid())
    vg, vbeta = vllm_ops().fused_gdn_gating_cpu(A_log, a, b, dt)
    torch.testing.assert_close(g, vg, rtol=1e-6, atol=1e-6)
    close(beta, vbeta, 2 ** -7, "beta vs vLLM")  # one bfloat16 ulp: vLLM rounds its sigmoid otherwise


# ---------------------------------------------------------------------------------------------------- conv1d


def test_causal_conv1d_over_two_sequences_equals_transformers_and_vllm(gen):
    x = randn(gen, T, DIM).t()  # the kernel takes the transpose of a contiguous (T, dim) tensor
    weight = randn(gen, DIM, WIDTH, scale=0.3)
    states = randn(gen, 4, DIM, WIDTH - 1)
    resume = torch.tensor([False, True])  # the second sequence continues from its slot's window
    ours_states, vllm_states = states.clone(), states.clone()
    ours = torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(x, weight, None, ours_states, SEQ, SLOTS, resume, True, -1,
                                                      False)
    theirs, tolerance = vllm_conv1d_fwd(x, weight, vllm_states, resume)
    assert ours.shape == (DIM, T) and ours.dtype == BF16
    close(ours, theirs, tolerance, "conv1d vs vLLM")
    torch.testing.assert_close(ours_states, vllm_states, rtol=0, atol=0)
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    for i, (start, end) in enumerate(zip(SEQ[:-1].tolist(), SEQ[1:].tolist())):
        window = states[SLOTS[i]] if resume[i] else torch.zeros(DIM, WIDTH - 1, dtype=BF16)
        # transformers convolves the window-prefixed sequence with zero padding; drop the window's outputs
        reference = causal_conv1d_fn(torch.cat([window, x[:, start:end]], -1)[None], weight, None, "silu")
        close(ours[:, start:end], reference[0, :, WIDTH - 1:], CONV_TO_TRANSFORMERS, f"conv1d vs transformers, sequence {i}")
        torch.testing.assert_close(ours_states[SLOTS[i]], x[:, end - WIDTH + 1:end])
    assert torch.equal(ours_states[[1, 3]], states[[1, 3]]), "slots of no sequence changed"


def test_causal_conv1d_update_equals_transformers_and_vllm(gen):
    x, weight = randn(gen, 3, DIM), randn(gen, DIM, WIDTH, scale=0.3)
    states = randn(gen, 4, DIM, WIDTH - 1)
    slots = torch.tensor([3, 1, 0], dtype=torch.int32)
    ours_states, vllm_states = states.clone(), states.clone()
    ours = torch.ops.sgl_kernel.causal_conv1d_update_cpu(x, ours_states, weight, None, True, None, slots, -1, False)
    theirs, tolerance = vllm_conv1d_update(x, weight, vllm_states, slots)
    close(ours, theirs, tolerance, "conv1d update vs vLLM")
    torch.testing.assert_close(ours_states, vllm_states, rtol=0, atol=0)
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    for i, slot in enumerate(slots.tolist()):
        window = states[slot][None].clone()
        reference = causal_conv1d_update(x[i][None, :, None], window, weight, None, "silu")
        close(ours[i], reference[0, :, 0], CONV_TO_TRANSFORMERS, f"conv1d update vs transformers, row {i}")
        torch.testing.assert_close(ours_states[slot], window[0])


# ---------------------------------------------------------------------------------------------------- delta rule


def _delta_inputs(gen, tokens):
    q, k = randn(gen, 1, tokens, HK, DK), randn(gen, 1, tokens, HK, DK)
    v = randn(gen, 1, tokens, HV, DV)
    g = -torch.rand(1, tokens, HV, generator=gen) * 0.5  # log decays <= 0
    beta = torch.rand(1, tokens, HV, generator=gen).to(BF16)
    return q, k, v, g, beta


def test_chunked_gated_delta_rule_over_two_sequences_equals_transformers_and_vllm(gen):
    q, k, v, g, beta = _delta_inputs(gen, T)
    pool = torch.randn(4, HV, DK, DV, generator=gen) * 0.1
    ours_pool, vllm_pool = pool.clone(), pool.clone()
    out, state, chunks = mamba.chunk_gated_delta_rule_cpu(q, k, v, g, beta, ours_pool, SEQ, False, True, SLOTS)
    assert out.shape == (1, T, HV, DV) and out.dtype == BF16 and state is ours_pool and chunks is None
    theirs, _ = vllm_ops().chunk_gated_delta_rule_cpu(q, k, v, g, beta, vllm_pool, True, SEQ, False, True, SLOTS)
    close(out, theirs, TO_VLLM, "delta rule vs vLLM")
    close(ours_pool, vllm_pool, TO_VLLM, "final states vs vLLM")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    for i, (start, end) in enumerate(zip(SEQ[:-1].tolist(), SEQ[1:].tolist())):
        # transformers takes the query and key already repeated to the value heads
        qi, ki = (t[:, start:end].repeat_interleave(HV // HK, dim=2) for t in (q, k))
        reference, final = torch_chunk_gated_delta_rule(qi, ki, v[:, start:end], g[:, start:end], beta[:, start:end],
                                                        initial_state=pool[SLOTS[i]][None], output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
        close(out[:, start:end], reference, TO_TRANSFORMERS, f"delta rule vs transformers, sequence {i}")
        close(ours_pool[SLOTS[i]], final[0], TO_TRANSFORMERS_STATE, f"final state vs transformers, sequence {i}")
    assert torch.equal(ours_pool[[1, 3]], pool[[1, 3]]), "slots of no sequence changed"


def test_recurrent_update_with_gating_equals_transformers_and_vllm(gen):
    q, k, v, _, _ = _delta_inputs(gen, 3)
    A_log, dt = torch.randn(HV, generator=gen), randn(gen, HV)
    a, b = randn(gen, 3, HV), randn(gen, 3, HV)
    pool = torch.randn(4, HV, DK, DV, generator=gen) * 0.1
    slots, starts = torch.tensor([3, 1, 0], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    ours_pool, vllm_pool = pool.clone(), pool.clone()
    # sglang calls it by keyword: the schema's names are part of the contract
    ours = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt, q=q, k=k, v=v, a=a, b=b, initial_state_source=ours_pool,
        initial_state_indices=slots, cu_seqlens=starts, use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
        softplus_threshold=20.0)
    theirs = vllm_ops().fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt, q, k, v, a, b, vllm_pool, slots,
                                                                    starts, True, 1.0, 20.0)
    assert ours.shape == theirs.shape == (3, 1, HV, DV)
    close(ours, theirs, TO_VLLM, "recurrent update vs vLLM")
    close(ours_pool, vllm_pool, TO_VLLM, "states vs vLLM")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = -A_log.float().exp() * F.softplus(a.float() + dt.float())
    for i, slot in enumerate(slots.tolist()):
        qi, ki = (t[:, i:i + 1].repeat_interleave(HV // HK, dim=2) for t in (q, k))
        reference, final = torch_recurrent_gated_delta_rule(qi, ki, v[:, i:i + 1], g[None, i:i + 1],
                                                            b[None, i:i + 1].sigmoid(), initial_state=pool[slot][None],
                                                            # (beta in b's dtype, as the layer computes it)
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        close(ours[i, 0], reference[0, 0], TO_TRANSFORMERS, f"recurrent update vs transformers, row {i}")
        close(ours_pool[slot], final[0], TO_TRANSFORMERS_STATE, f"state vs transformers, row {i}")


def test_a_prefill_then_decodes_equal_one_long_prefill(gen):
    """The engine's own use: a prompt's chunked pass leaves conv window and state in the slot, and each decoded
    token continues from them; the same as convolving and running the delta rule over all tokens at once."""
    tokens, dim = 12, (2 * HK * DK + HV * DV)
    x = randn(gen, tokens, dim)
    weight = randn(gen, dim, WIDTH, scale=0.3)
    A_log, dt = torch.randn(HV, generator=gen), randn(gen, HV)
    a, b = randn(gen, tokens, HV), randn(gen, tokens, HV)

    def mixer(qkv, g, beta, conv_states, pool, one_at_a_time):
        """conv -> split -> delta rule, either token by token (decode) or as one prefill."""
        slot = torch.tensor([1], dtype=torch.int32)
        if one_at_a_time:
            mixed = torch.ops.sgl_kernel.causal_conv1d_update_cpu(qkv, conv_states, weight, None, True, None, slot,
                                                                  -1, False)
        else:
            mixed = torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(qkv.t(), weight, None, conv_states,
                                                               torch.tensor([0, len(qkv)], dtype=torch.int32), slot,
                                                               torch.tensor([False]), True, -1, False).t()
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
        q, k, v = q.reshape(1, -1, HK, DK), k.reshape(1, -1, HK, DK), v.reshape(1, -1, HV, DV)
        if one_at_a_time:
            return torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log, dt, q, k, v, g, beta, pool, slot, torch.tensor([0, 1], dtype=torch.int32), True)[:, 0]
        gg, bb = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, g, beta, dt)
        return mamba.chunk_gated_delta_rule_cpu(q, k, v, gg, bb, pool, torch.tensor([0, len(qkv)]), False, True,
                                                slot)[0][0]

    conv, pool = torch.zeros(2, dim, WIDTH - 1, dtype=BF16), torch.zeros(2, HV, DK, DV)
    whole = mixer(x, a, b, conv.clone(), pool.clone(), one_at_a_time=False)
    first = mixer(x[:5], a[:5], b[:5], conv, pool, one_at_a_time=False)
    rest = torch.cat([mixer(x[t:t + 1], a[t:t + 1], b[t:t + 1], conv, pool, one_at_a_time=True)
                      for t in range(5, tokens)])
    # the decoded tokens' conv outputs are rounded to bfloat16 before the delta rule, the prefill's too: 2 ulps
    close(torch.cat([first, rest]), whole, 2 ** -7, "prefill + decode vs one prefill")
