"""A MoE run's own checkpoints load where users take them: a one-step fit on each embedded MoE model writes a
checkpoint (its experts trained) that transformers, vLLM and SGLang (where it serves the family on this CPU) each
start on, to the same greedy outputs. transformers 5.19's own `save_pretrained` of Qwen3-VL-MoE holds the experts
in its in-memory orientation, which vLLM refuses at start ("The size of tensor a (48) must match the size of tensor
b (128)"); vlmrl writes the hub's layout by the conversion its weight sync uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_problems
from tests.trainer.test_fit import base_args
from vlmrl.config import load_config
from vlmrl.models.tiny import ensure_built
from vlmrl.rollout.registry import get_backend
from vlmrl.trainer.fit import fit

pytestmark = [pytest.mark.vllm, pytest.mark.sglang, pytest.mark.slow]


def _experts(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if ".mlp.experts." in name}


def trained_checkpoint(variant: str, out: Path) -> Path:
    """The checkpoint of a one-step run (hf rollout: the engines meet the folder only when started on it); its
    expert tensors moved from the base model's."""
    base = ensure_built(variant)
    fit(load_config(base_args(str(base), out, "trainer.total_steps=1", "trainer.save_freq=1",
                              "trainer.val_before_train=false", "data.val_files=", "trainer.test_freq=-1")))
    latest = out / "checkpoints" / "latest"
    before, after = _experts(base), _experts(latest)
    assert before.keys() == after.keys(), "the checkpoint holds the experts under the base model's names"
    assert any(not torch.equal(before[name], after[name]) for name in before), "one step trained no expert"
    return latest


def _greedy(backend_name: str, path: Path, dtype: str, requests):
    with get_backend(backend_name, str(path), dtype=dtype, max_model_len=1024, timeout_s=300) as backend:
        return backend.generate(requests, GREEDY)


def test_a_qwen3_vl_moe_checkpoint_starts_vllm_and_sglang_to_transformers_outputs(moe_batch, tmp_path):
    """float32: nine requests with 0-2 images, greedy token for token and logprobs to float rounding on both."""
    latest = trained_checkpoint("tiny-qwen3-vl-moe", tmp_path / "run")
    expected = _greedy("hf", latest, "float32", moe_batch)
    for engine in ("vllm", "sglang"):
        problems = greedy_problems(expected, _greedy(engine, latest, "float32", moe_batch), engine, LOGPROB_TOL)
        assert not problems, f"{engine} on the run's checkpoint != transformers on it:\n" + "\n".join(problems)


def test_a_qwen3_5_moe_checkpoint_starts_vllm_to_transformers_outputs(moe_batch, tmp_path):
    """bfloat16 (vLLM's only CPU dtype for it; SGLang needs AMX for this family on a CPU): vLLM's greedy tokens on the
    nine requests score under transformers within bfloat16's drift (the family matrix's rule for it,
    tests.rollout.moe_contract.drift_problems)."""
    from tests.rollout.moe_contract import drift_problems

    latest = trained_checkpoint("tiny-qwen3.5-moe", tmp_path / "run")
    results = _greedy("vllm", latest, "bfloat16", moe_batch)
    with get_backend("hf", str(latest), dtype="bfloat16", max_model_len=1024, timeout_s=300) as hf16, \
            get_backend("hf", str(latest), dtype="float32", max_model_len=1024, timeout_s=300) as hf32:
        problems = drift_problems(hf32, hf16, moe_batch, results)
    assert not problems, problems
