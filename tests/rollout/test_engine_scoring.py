"""Teacher-forced scoring on the engines (`RolloutBackend.score`, what an engine-side distillation teacher gives):
each engine's logprobs of given response tokens on the same requests equal transformers' teacher-forced ones, and
of its own samples equal the logprobs it returned when sampling; fp32, on the session's shared engines. The checks
around every backend's scoring run on `hf` (no engine)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.rollout.helpers import LOGPROB_TOL
from vlmrl.rollout.errors import InvalidRequestError
from vlmrl.types import SamplingParams

SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=8, seed=7)


def worst_difference(expected: list[list[float]], got: list[list[float]], what: str) -> float:
    """max |expected - got| over every token; the lengths must be equal."""
    assert [len(x) for x in got] == [len(x) for x in expected], f"{what}: another number of logprobs"
    return max(abs(a - b) for x, y in zip(expected, got) for a, b in zip(x, y))


class ScoringContract:
    """What every engine's `score` must give; a subclass names its shared engine as the `backend` fixture."""

    def test_score_of_hf_greedy_responses_equals_hf_teacher_forced(self, backend, hf, batch, hf_greedy):
        """Nine requests (0, 1 and 2 images): the engine's scores of HF's greedy responses equal HF's own
        teacher-forced logprobs (fp32, the engine contract's tolerance)."""
        responses = [r.response_ids for r in hf_greedy]
        expected, got = hf.score(batch, responses), backend.score(batch, responses)
        worst = worst_difference(expected, got, backend.name)
        assert worst <= LOGPROB_TOL, f"{backend.name} score vs hf teacher-forced: max |d| {worst:.2e}"

    def test_score_of_own_samples_equals_the_sampled_logprobs(self, backend, batch):
        """Sampled at T = 0.7 (raw logprobs), then scored: the same values, token for token."""
        results = backend.generate(batch, SAMPLED)
        got = backend.score(batch, [r.response_ids for r in results])
        worst = worst_difference([r.response_logprobs for r in results], got, backend.name)
        assert worst <= LOGPROB_TOL, f"{backend.name} score vs its sampled logprobs: max |d| {worst:.2e}"

    def test_score_of_the_vocabulary_edges_equals_hf(self, backend, hf, batch, hf_greedy):
        """A response holding the vocabulary's first and last ids (an untrained model samples its padded tail;
        SGLang reports the last id as 0 in its input ids) scores as in HF."""
        last = hf.model.get_output_embeddings().weight.shape[0] - 1
        responses = [[last, *r.response_ids[:3], 0, last] for r in hf_greedy[2:5]]
        worst = worst_difference(hf.score(batch[2:5], responses), backend.score(batch[2:5], responses), backend.name)
        assert worst <= LOGPROB_TOL, f"{backend.name} score vs hf teacher-forced: max |d| {worst:.2e}"


@pytest.mark.vllm
class TestVLLM(ScoringContract):
    @pytest.fixture
    def backend(self, vllm_qwen2_5_vl):
        return vllm_qwen2_5_vl


@pytest.mark.sglang
class TestSGLang(ScoringContract):
    @pytest.fixture
    def backend(self, sglang_qwen2_5_vl):
        return sglang_qwen2_5_vl


@pytest.mark.sglang
class TestSGLangServer(ScoringContract):
    @pytest.fixture
    def backend(self, sglang_server_qwen2_5_vl):
        return sglang_server_qwen2_5_vl


def test_hf_batch_score_equals_its_per_request_score_and_empty_scores_nothing(hf, batch, hf_greedy):
    """The batch call and the one-request call are one computation; an empty response scores [] and leaves the
    others' scores as they are."""
    responses = [r.response_ids for r in hf_greedy[2:5]]
    batched = hf.score(batch[2:5], [responses[0], [], responses[2]])
    assert batched == [hf.score([batch[2]], [responses[0]])[0], [], hf.score([batch[4]], [responses[2]])[0]]


def test_what_no_engine_can_score_is_refused_naming_the_request(hf, batch):
    pad = hf.processor.image_token_id
    with pytest.raises(InvalidRequestError, match="2 responses for 3 requests"):
        hf.score(batch[:3], [[1], [2]])
    with pytest.raises(InvalidRequestError, match=rf"request 1 \(uid {batch[4].uid}.*placeholder id\(s\) \[{pad}\]"):
        hf.score(batch[3:5], [[1], [5, pad]])
    with pytest.raises(InvalidRequestError, match=r"\+ response \+ 1 generated=1001 > max_model_len=1024"):
        hf.score([batch[0]], [[30] * 1000])
    bad = dataclasses.replace(batch[6], images=batch[6].images[:1])
    with pytest.raises(InvalidRequestError, match="2 <\\|image_pad\\|> placeholders"):
        hf.score([bad], [[1]])
