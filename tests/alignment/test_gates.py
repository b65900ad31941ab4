"""Determinism and consistency gates: the pure rules on hand-built results (a cloned group, an engine seeded per
batch, a batch-dependent result), then `compare --gate` on the real hf backend."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from vlmrl.alignment.compare import main
from vlmrl.alignment.gates import (
    batch_invariance_gate,
    cross_instance_gate,
    diversity_gate,
    reproducibility_gate,
)
from vlmrl.types import RolloutResult, SamplingParams

SAMPLING = SamplingParams(n=4, temperature=1.0, seed=7)
PROBS = np.array([0.6, 0.25, 0.1, 0.05])
"""A toy engine's next-token distribution (the same at every position)."""


def toy_engine(prompts: list[str], rng_for_prompt, n: int = 4, length: int = 6) -> list[RolloutResult]:
    """n samples of `length` tokens per prompt from PROBS, each prompt's draws from rng_for_prompt(position)."""
    out = []
    for position, uid in enumerate(prompts):
        rng = rng_for_prompt(position)
        for i in range(n):
            ids = rng.choice(len(PROBS), size=length, p=PROBS).tolist()
            out.append(RolloutResult(uid, i, ids, [math.log(PROBS[t]) for t in ids], "length"))
    return out


def seeded_per_request(base: int):
    """What the contract asks: a request's samples depend on (seed, its position) only."""
    return lambda position: np.random.default_rng(base + position * 4)


PROMPTS = [f"p{i}" for i in range(6)]


# ---------------------------------------------------------------------------------------------------- equality gates


def test_an_engine_seeded_per_request_passes_run_twice():
    gate = reproducibility_gate(toy_engine(PROMPTS, seeded_per_request(7)), toy_engine(PROMPTS, seeded_per_request(7)))
    assert gate.ok and gate.checked == 24 and gate.findings == []


def test_an_engine_seeded_once_per_batch_fails_run_twice_naming_the_samples():
    """An engine that seeds one generator per batch call (a global counter) draws other samples the second time."""
    calls = iter(range(100))

    def seeded_per_batch():
        rng = np.random.default_rng(next(calls))
        return lambda position: rng

    gate = reproducibility_gate(toy_engine(PROMPTS, seeded_per_batch()), toy_engine(PROMPTS, seeded_per_batch()))
    assert not gate.ok
    assert any(f.startswith("p0#0: run 1 vs run 2: tokens split at position") for f in gate.findings), gate.findings


def test_a_batch_dependent_logprob_fails_batch_invariance_and_is_named():
    alone = toy_engine(PROMPTS, seeded_per_request(7))
    batched = toy_engine(PROMPTS, seeded_per_request(7))
    batched[9].response_logprobs[2] += 3e-3  # e.g. a kernel whose reduction order follows the batch size
    gate = batch_invariance_gate(alone, batched)
    assert not gate.ok and gate.findings == [
        "p2#1: alone vs in the batch: same tokens, logprobs up to 0.003 nats apart (tolerance 0.0001)"]
    assert batch_invariance_gate(alone, batched, tolerance=1e-2).ok


def test_a_batch_dependent_token_and_a_missing_sample_fail():
    alone = toy_engine(PROMPTS, seeded_per_request(7))
    batched = toy_engine(PROMPTS, seeded_per_request(7))
    batched[0].response_ids[3] = 99
    del batched[-1]
    gate = cross_instance_gate(alone, batched)
    assert not gate.ok
    assert "sample p5#3 is in only one of instance 1 / instance 2" in gate.findings
    assert "p0#0: instance 1 vs instance 2: tokens split at position 3 (lengths 6 vs 6)" in gate.findings


# ---------------------------------------------------------------------------------------------------- diversity


def test_correct_sampling_passes_the_diversity_gate_over_many_groups():
    """200 groups of 8 drawn independently from PROBS (short responses, so repeats happen): no false alarm."""
    results = toy_engine([f"p{i}" for i in range(200)], seeded_per_request(3), n=8, length=2)
    repeats = sum(len({tuple(r.response_ids) for r in results[g * 8:(g + 1) * 8]}) < 8 for g in range(200))
    assert repeats > 150, "the test needs groups with repeated responses to mean anything"
    gate = diversity_gate(results, SamplingParams(n=8, temperature=1.0))
    assert gate.ok and gate.checked == 200 and gate.note == ""


def test_a_cloned_group_fails_the_diversity_gate():
    """A deterministic mode gives all 4 samples of p1 one response: its 6 tokens have probability 1e-5, so 4
    independent draws would repeat it with chance 1e-15."""
    results = toy_engine(PROMPTS, seeded_per_request(7))
    clone = results[4]
    results[4:8] = [RolloutResult("p1", i, list(clone.response_ids), list(clone.response_logprobs), "length")
                    for i in range(4)]
    gate = diversity_gate(results, SAMPLING)
    assert not gate.ok and len(gate.findings) == 1
    assert gate.findings[0].startswith("p1: 4 of 4 samples are the same response (1 distinct, 6 tokens")


def test_a_confident_model_repeating_a_near_certain_answer_passes():
    results = [RolloutResult("p0", i, [5, 2], [-1e-3, -2e-3], "stop") for i in range(8)]
    assert diversity_gate(results, SamplingParams(n=8, temperature=1.0)).ok


def test_the_diversity_gate_refuses_greedy_sampling_and_notes_truncated_sampling():
    results = toy_engine(PROMPTS, seeded_per_request(7))
    with pytest.raises(ValueError, match="temperature > 0"):
        diversity_gate(results, SamplingParams(n=4, temperature=0.0))
    assert "approximate" in diversity_gate(results, SamplingParams(n=4, temperature=0.7)).note


# ---------------------------------------------------------------------------------------------------- real backend


def gate_args(model_path: str, out, *extra: str) -> list[str]:
    return ["--backend", "hf", "--gate-rows", "4", "--out", str(out), f"actor.model_path={model_path}",
            "data.train_files=synthetic", "data.val_files=synthetic", "data.synthetic_val_size=4",
            "data.max_prompt_length=64", "data.max_response_length=8", "data.max_pixels=12544", "rollout.n=4",
            "rollout.temperature=1.0", "rollout.hf.device=cpu", *extra]


@pytest.fixture(scope="module")
def hf_gates(tiny_model_path, tmp_path_factory):
    """`compare --gate all` on the hf backend: one instance for three gates, a second for cross-instance."""
    out = tmp_path_factory.mktemp("gates")
    code = main(["--gate", "all", *gate_args(tiny_model_path, out)])
    report = json.loads((out / "gates.json").read_text())
    return code, {gate["name"]: gate for gate in report["gates"]}


@pytest.mark.parametrize("name", ["reproducibility", "batch", "cross-instance", "diversity"])
def test_the_hf_backend_passes_each_gate(hf_gates, name):
    code, gates = hf_gates
    assert code == 0 and set(gates) == {"reproducibility", "batch", "cross-instance", "diversity"}
    gate = gates[name]
    assert gate["ok"], gate["findings"]
    assert gate["checked"] == (4 if name == "diversity" else 16)


def test_top_k_1_clones_every_group_and_the_diversity_gate_exits_1(tiny_model_path, tmp_path, capsys):
    """rollout.top_k=1 at temperature 1 is greedy decoding in disguise: every group's samples are one response."""
    out = tmp_path / "gate"
    assert main(["--gate", "diversity", *gate_args(tiny_model_path, out, "rollout.top_k=1")]) == 1
    gate = json.loads((out / "gates.json").read_text())["gates"][0]
    assert not gate["ok"] and len(gate["findings"]) == 4 and "approximate" in gate["note"]
    assert "FAIL diversity" in capsys.readouterr().out


def test_a_bad_backend_or_config_exits_2_before_any_engine(tmp_path, capsys):
    assert main(["--gate", "all", *gate_args("tiny", tmp_path), "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
    assert main(["--gate", "all", *gate_args("tiny", tmp_path), "rollout.n=0"]) == 2
    assert "rollout.n" in capsys.readouterr().err
    assert not (tmp_path / "gates.json").exists()


# Real engines (marker `full`, make test-all: each starts its engine twice, 45-60 s on 2 cores).


@pytest.mark.vllm
@pytest.mark.full
def test_vllm_passes_every_gate(tiny_model_path, tmp_path):
    out = tmp_path / "gate"
    assert main(["--gate", "all", *gate_args(tiny_model_path, out, "--backend", "vllm", "rollout.dtype=float32")]) == 0
    gates = json.loads((out / "gates.json").read_text())["gates"]
    assert [(g["name"], g["ok"]) for g in gates] == [("reproducibility", True), ("batch", True),
                                                     ("cross-instance", True), ("diversity", True)]


@pytest.mark.sglang
@pytest.mark.full
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU SGLang can honour sampling seeds")
def test_sglang_on_a_cpu_fails_run_twice_because_it_cannot_honour_sampling_seeds(tiny_model_path, tmp_path):
    """torch_native attention (the one that runs on a CPU) refuses enable_deterministic_inference, without which
    SGLang ignores sampling_seed (docs/engines.md): a second call draws other samples, while a fresh instance's first
    call repeats the first instance's (both start from random_seed)."""
    out = tmp_path / "gate"
    args = gate_args(tiny_model_path, out, "--backend", "sglang", "rollout.dtype=float32")
    assert main(["--gate", "all", *args]) == 1
    gates = {g["name"]: g for g in json.loads((out / "gates.json").read_text())["gates"]}
    assert not gates["reproducibility"]["ok"] and not gates["batch"]["ok"]
    assert "run 1 vs run 2: tokens split" in gates["reproducibility"]["findings"][0]
    assert gates["cross-instance"]["ok"] and gates["diversity"]["ok"]
