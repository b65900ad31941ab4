"""SGLang Engine (bfloat16, CPU, the sgl_kernel stand-in's Gated DeltaNet ops) on the embedded Qwen3.5 against
transformers in bfloat16: (its bfloat16 engine contract and videos: tests/rollout/test_family_contract.py) the CPU settings vlmrl starts SGLang
with, and the config keys it passes where config.json lacks what SGLang reads."""

from __future__ import annotations

import json

import pytest

from tests.rollout.helpers import BF16_LOGPROB_TOL, GREEDY, greedy_problems

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_qwen3_5):
    return sglang_qwen3_5


def test_the_engine_starts_with_the_familys_cpu_settings(backend, tiny_model_path):
    """no_buffer mamba cache (the default extra_buffer needs state snapshots the CPU platform lacks) without the
    overlap schedule (no_buffer refuses it), bfloat16; the tiny config needs no override."""
    from vlmrl.rollout.sglang import engine_args

    args = engine_args(tiny_model_path, backend.options, backend.processor.family, on_cuda=False, backend="sglang")
    assert args["mamba_radix_cache_strategy"] == "no_buffer" and args["disable_overlap_schedule"] is True
    assert args["dtype"] == "bfloat16" and "json_model_override_args" not in args
    on_gpu = engine_args(tiny_model_path, backend.options, backend.processor.family, on_cuda=True, backend="sglang")
    assert "mamba_radix_cache_strategy" not in on_gpu, "SGLang's own defaults on GPU"


def test_a_config_without_the_keys_sglang_reads_gets_them_and_matches_hf(backend, bare_config_path, hf, batch,
                                                                       hf_greedy):
    """On a config without full_attention_interval, deepstack_visual_indexes and mrope_interleaved (transformers
    computes the same model without them) vlmrl starts SGLang with all three: HF's outputs again."""
    from vlmrl.rollout.registry import get_backend
    from vlmrl.rollout.sglang import engine_args

    backend.close()  # one SGLang engine at a time
    args = engine_args(bare_config_path, backend.options, backend.processor.family, on_cuda=False, backend="sglang")
    given = json.loads(args["json_model_override_args"])
    assert given["text_config"]["full_attention_interval"] == 3
    assert given["vision_config"] == {"deepstack_visual_indexes": []}
    assert given["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    with get_backend("sglang", bare_config_path, dtype="bfloat16", max_model_len=1024, timeout_s=300) as fixed:
        results = fixed.generate(batch, GREEDY)
    problems = greedy_problems(hf_greedy, results, "sglang", BF16_LOGPROB_TOL, BF16_LOGPROB_TOL, ties_allowed=True)
    assert not problems, "\n".join(problems)
