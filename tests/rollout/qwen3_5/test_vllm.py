"""vLLM (in-process, bfloat16) on the embedded Qwen3.5 against transformers in bfloat16: the settings vlmrl passes or refuses before vLLM starts."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY
from tests.rollout.qwen3_5.conftest import edited_copy
from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_qwen3_5):
    return vllm_qwen3_5


def test_auto_dtype_is_bfloat16_on_cpu_and_float32_is_refused_before_the_engine(backend, tiny_model_path, tmp_path):
    """rollout.dtype=auto starts the engine in bfloat16 on a CPU; float32, or linear-attention heads of another size
    than 128, are refused naming the fix before vLLM is constructed (it would fail deep inside its GDN kernel)."""
    from vlmrl.rollout.base import BackendOptions
    from vlmrl.rollout.vllm import engine_kwargs

    options = BackendOptions.from_kwargs("vllm", {"max_model_len": 1024})
    kwargs, _ = engine_kwargs(tiny_model_path, options, backend.processor.family, on_cuda=False)
    assert kwargs["dtype"] == "bfloat16" and "hf_overrides" not in kwargs
    with pytest.raises(RolloutError, match="Qwen3.5 runs in bfloat16 on CPU engines.*rollout.dtype=bfloat16"):
        get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024)

    def small_heads(config):
        config["text_config"]["linear_key_head_dim"] = config["text_config"]["linear_value_head_dim"] = 32

    small = edited_copy(tiny_model_path, tmp_path / "small-heads", small_heads)
    with pytest.raises(RolloutError, match="vllm on CPU takes linear-attention heads of 128 only"):
        get_backend("vllm", small, dtype="bfloat16", max_model_len=1024)
    assert backend.generate(GREEDY and [], GREEDY) == []
