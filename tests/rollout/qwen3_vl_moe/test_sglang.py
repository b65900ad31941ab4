"""SGLang Engine (fp32, CPU) on the embedded Qwen3-VL-MoE: a config SGLang would compute another model from (not three
deepstack layers, a dense decoder layer) refused before it starts. The engine contract is the family matrix's
(tests/rollout/test_family_contract.py)."""

from __future__ import annotations

import pytest

from tests.rollout.qwen3_5.conftest import edited_copy
from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_qwen3_vl_moe):
    return sglang_qwen3_vl_moe


def test_two_deepstack_layers_are_refused_before_the_engine(backend, tiny_model_path, tmp_path):
    """SGLang's Qwen3-VL-MoE adds three deepstack embeddings whatever the config says (its scheduler died on the
    first image with two): such a config is named before SGLang starts."""
    def two(config):
        config["vision_config"]["deepstack_visual_indexes"] = [0, 1]

    with pytest.raises(RolloutError, match="adds exactly 3, as the released models have"):
        get_backend("sglang", edited_copy(tiny_model_path, tmp_path / "two", two), dtype="float32",
                    max_model_len=1024)


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}], ids=["mlp-only", "step-2"])
def test_a_config_with_dense_layers_is_refused_before_the_engine(tiny_model_path, tmp_path, dense):
    """SGLang builds every Qwen3-VL-MoE layer as MoE: a dense layer would run with experts it never loaded (another
    model, silently). Named before SGLang starts."""
    def with_dense(config):
        config["text_config"].update(dense)

    with pytest.raises(RolloutError, match=r"dense decoder layers \[.*\].*builds every layer as MoE"):
        get_backend("sglang", edited_copy(tiny_model_path, tmp_path / "dense", with_dense), dtype="float32",
                    max_model_len=1024)
