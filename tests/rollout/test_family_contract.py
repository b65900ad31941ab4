"""The engine contract on every embedded family and every engine it runs on: one line per family in `MATRIX`. Each
line names the contract the family is held to (tests.rollout.helpers.EngineContract for the dense families, with
their tolerances and own checks: Qwen3-VL's deepstack mergers, Qwen3.5's bfloat16 band and linear-attention tensors,
InternVL's tiles; tests.rollout.moe_contract for the Mixture-of-Experts families: every kind of expert tensor, and
Qwen3.5-MoE's bfloat16 drift band), the engines, which of them only the `full` tier runs, and the engines its video
contract runs on.

A class per (family, engine) is made from the line; it runs on the session's shared engine of that pair
(`shared_engine`, tests/rollout/conftest.py: one start per engine and model, shared with that engine's other tests on
the family) and on the family's transformers reference, batch and greedy results (`References`). A family's own
settings and refusals (a config without a key an engine reads, an engine-specific path) stay in its folder
(tests/rollout/<family>/: the MoE families' routing capture, routing replay and expert LoRA are there too).

A new family: an entry in `vlmrl.models.families.FAMILIES`, its tiny builder, and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.rollout.helpers import EngineContract, Qwen3_5Contract, Qwen3_5VideoContract, Qwen3VLContract
from tests.rollout.moe_contract import Qwen3_5MoEContract, Qwen3VLMoEContract, Qwen3VLMoEVideoContract


class TileContract(EngineContract):
    """A tile-layout family (InternVL): an image is 18-82 tokens here, whose hidden states outnumber the text's and
    pull the all-positions mean off the direction that predicts a first token (the pad token then leads on 6 of
    the 9 prompts at any strength), so the pad-ban test favours the pad along the last positions only."""

    favour_last_positions = True


@dataclass(frozen=True)
class Line:
    contract: type
    engines: tuple[str, ...] = ("vllm", "sglang", "sglang-server")
    full: tuple[str, ...] = ("sglang-server",)
    """Engines run only by `make test-all`: another engine covers the same path in make test (a launched server's
    sync is the same files and /update_weights_from_disk on every family; its start costs 23-40 s)."""
    video: type | None = None
    video_engines: tuple[str, ...] = ()
    in_process_only: tuple[str, ...] = ()
    """Tests of the contract that the launched server (sglang-server) does not run: the in-process engine runs them
    through the same update path in SGLang."""


MATRIX: dict[str, Line] = {
    "tiny": Line(EngineContract, full=()),
    "tiny-qwen3-vl": Line(Qwen3VLContract),
    "tiny-qwen3.5": Line(Qwen3_5Contract, video=Qwen3_5VideoContract, video_engines=("vllm", "sglang")),
    "tiny-glm4v": Line(EngineContract),
    "tiny-internvl": Line(TileContract),
    # the server gets the rolled experts, bucketed, through its disk shards; the per-kind pushes stay in-process. No
    # videos on the server: it refuses them for every family (tests/rollout/test_video_sglang_server.py)
    "tiny-qwen3-vl-moe": Line(Qwen3VLMoEContract, video=Qwen3VLMoEVideoContract, video_engines=("vllm", "sglang"),
                              in_process_only=("test_every_kind_of_moe_tensor_lands",)),
    # SGLang serves it on a CPU only with Intel AMX (refused before start: tests/rollout/qwen3_5_moe/)
    "tiny-qwen3.5-moe": Line(Qwen3_5MoEContract, engines=("vllm",), full=()),
}
"""Embedded model -> how its family is held to the contract."""

MARKS = {"vllm": pytest.mark.vllm, "sglang": pytest.mark.sglang, "sglang-server": pytest.mark.sglang}


class OnSharedEngine:
    """The fixtures a contract class reads, for the class's own (engine, model): `shared_engine`. Class-scoped, so
    classmethods (pytest's rule: one call per class, not per test instance)."""

    shared_engine: tuple[str, str]

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model_path(cls) -> str:
        from vlmrl.models.tiny import ensure_built

        return str(ensure_built(cls.shared_engine[1]))

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, shared_engines):
        return shared_engines.get(*cls.shared_engine)

    @pytest.fixture(scope="class")
    @classmethod
    def hf(cls, references, tiny_model_path):
        return references.hf(tiny_model_path)

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, references, tiny_model_path):
        return references.batch(tiny_model_path)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_greedy(cls, references, tiny_model_path):
        return references.hf_greedy(tiny_model_path)


def _classes() -> dict[str, type]:
    out = {}
    for model, line in MATRIX.items():
        for engine in line.engines:
            bases = [OnSharedEngine, line.contract]
            if line.video is not None and engine in line.video_engines:
                bases.append(line.video)
            marks = [MARKS[engine]] + ([pytest.mark.full] if engine in line.full else [])
            name = "Test_" + "_".join(part.replace("-", "_").replace(".", "_") for part in (engine, model))
            body = {"shared_engine": (engine, model), "pytestmark": marks, "__module__": __name__}
            if engine == "sglang-server":
                body.update(dict.fromkeys(line.in_process_only))  # None: not collected
            out[name] = type(name, tuple(bases), body)
    return out


globals().update(_classes())


def test_every_family_has_a_line():
    """A family in FAMILIES (dense or Mixture-of-Experts) whose embedded models have no line here would run no engine
    contract."""
    from vlmrl.models.families import FAMILIES

    missing = [f.name for f in FAMILIES if not set(f.tiny_variants) & set(MATRIX)]
    assert not missing, f"families without a line in MATRIX: {missing}"
