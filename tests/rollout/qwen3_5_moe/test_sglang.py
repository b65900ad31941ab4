"""SGLang on the embedded Qwen3.5-MoE: refused on a CPU without AMX, before it starts (its engine contract runs on
vLLM only: the family matrix, tests/rollout/test_family_contract.py)."""

from __future__ import annotations

import pytest

from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.sglang


def test_sglang_is_refused_on_a_cpu_without_amx(tiny_model_path):
    from vlmrl.models.families import cpu_has_amx

    if cpu_has_amx():
        pytest.skip("this CPU has AMX: SGLang serves Qwen3.5-MoE here (its shared-expert gate then runs on AMX)")
    with pytest.raises(RolloutError, match="serves Qwen3.5-MoE on a CPU only with Intel AMX"):
        get_backend("sglang", tiny_model_path, dtype="bfloat16", max_model_len=1024)
