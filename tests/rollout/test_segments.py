"""Generation in segments (vlmrl.rollout.segments, the asynchronous placement's interrupt_tokens) on real engines:
greedy decoding gives the one-call tokens and logprobs in segments; new weights loaded between two segments carry
on each unfinished sample from where it stopped, as those weights would."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.rollout.helpers import GREEDY
from vlmrl.rollout.segments import generate_in_segments
from vlmrl.types import SamplingParams

GREEDY_6 = replace(GREEDY, max_new_tokens=6, top_logprobs=0)


def _same_as_one_call(engine, batch, sampling, tol: float) -> None:
    calls = []
    whole = engine.generate(batch, sampling)
    parts, versions = generate_in_segments(engine, batch, sampling, segment_tokens=2, version=7,
                                           between=lambda: calls.append(1) or 7)
    assert [r.response_ids for r in parts] == [r.response_ids for r in whole]
    assert [r.finish_reason for r in parts] == [r.finish_reason for r in whole]
    assert [r.uid for r in parts] == [r.uid for r in whole]
    for a, b in zip(parts, whole):
        assert max((abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)), default=0.0) < tol
    assert len(calls) == 2 and versions == [(7, 7)] * len(whole), "two boundaries in 6 tokens at 2 a segment"


def test_greedy_in_segments_is_the_one_call_greedy_on_hf(hf, batch):
    _same_as_one_call(hf, batch, GREEDY_6, 1e-5)


@pytest.mark.vllm
def test_greedy_in_segments_is_the_one_call_greedy_on_vllm(vllm_qwen2_5_vl, batch):
    _same_as_one_call(vllm_qwen2_5_vl, batch, GREEDY_6, 1e-4)


def test_seeded_samples_in_segments_keep_n_per_request_and_the_token_budget(hf, batch):
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=11)
    results, versions = generate_in_segments(hf, batch[:4], sampling, segment_tokens=2, version=0, between=lambda: 1)
    assert len(results) == 12 and [r.uid for r in results] == [q.uid for q in batch[:4] for _ in range(3)]
    assert [r.sample_index for r in results] == [0, 1, 2] * 4
    for r, (first, last) in zip(results, versions):
        assert 1 <= len(r.response_ids) <= 5 and len(r.response_logprobs) == len(r.response_ids)
        assert first == 0 and last == (1 if len(r.response_ids) > 2 else 0)
        assert r.finish_reason == "stop" if len(r.response_ids) < 5 else r.finish_reason in ("stop", "length")


@pytest.fixture
def own_hf(tiny_model_path):
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024) as started:
        yield started


def test_weights_loaded_between_segments_carry_on_each_sample(own_hf, batch, tiny_model_path):
    """The interruption itself: after the first 2-token segment, new weights (every decoder weight moved) load; the
    samples' last 4 tokens are then what the new weights generate greedily after the first 2, not what the old
    weights would have, and their logprobs are the new weights'."""
    from safetensors.torch import load_file

    requests = batch[:3]
    old = own_hf.generate(requests, GREEDY_6)
    state = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.is_floating_point() and v.ndim > 1
             and "layers" in k else v for k, v in state.items()}

    def between() -> int:
        own_hf.update_weights(list(moved.items()))
        return 1

    results, versions = generate_in_segments(own_hf, requests, GREEDY_6, segment_tokens=2, version=0,
                                             between=between)
    continued = [replace(q, prompt_ids=[*q.prompt_ids, *o.response_ids[:2]]) for q, o in zip(requests, old)]
    expected = own_hf.generate(continued, replace(GREEDY_6, max_new_tokens=4))  # the new weights, from token 2
    for r, o, e, v in zip(results, old, expected, versions):
        assert r.response_ids[:2] == o.response_ids[:2] and r.response_ids[2:] == e.response_ids
        assert r.response_logprobs[2:] == pytest.approx(e.response_logprobs, abs=1e-5)
        assert v == (0, 1)
    assert any(r.response_ids != o.response_ids for r, o in zip(results, old)), "the new weights changed a sample"
