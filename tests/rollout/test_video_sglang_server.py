"""sglang-server with videos (a real server vlmrl launches, fp32, CPU): video requests are refused with a clear error
before any HTTP call, and the server keeps serving; and the reason still holds: the server's /generate rejects the
processor outputs the Engine path sends (the only form in which SGLang computes what transformers computes for a
Qwen2.5-VL video, see vlmrl.rollout.sglang). When a later SGLang accepts them, the second test fails: then the
refusal can give way to the Engine's request."""

from __future__ import annotations

import re

import pytest

from tests.rollout.helpers import GREEDY, greedy_mismatch
from tests.rollout.video_helpers import video_batch
from vlmrl.rollout.errors import InvalidRequestError, RolloutError

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_server_qwen2_5_vl):
    """The server the other Qwen2.5-VL server tests use (its multimodal cache on, which a refusal before any HTTP call
    and the server's own rejection of the request's form do not depend on)."""
    return sglang_server_qwen2_5_vl


def test_video_requests_are_refused_and_the_server_keeps_serving(backend, tiny_model_path, batch, hf_greedy):
    videos = video_batch(tiny_model_path, 2.0)
    with pytest.raises(InvalidRequestError, match=f"^sglang-server: request {re.escape(videos[1].uid)} holds 1 video.*24 fps.*"
                                                  r"use the sglang \(Engine\), vllm or hf backend"):
        backend.generate([batch[0], videos[1]], GREEDY)  # a batch with one video row among others: refused whole
    got = backend.generate(batch[:3], GREEDY)
    problems = [m for ref, res in zip(hf_greedy, got) if (m := greedy_mismatch(ref, res, "sglang-server"))]
    assert not problems, "\n".join(problems)


def test_the_server_rejects_processor_outputs_over_http(backend, tiny_model_path, batch, hf_greedy):
    """The Engine's video request (vlmrl's processor outputs, tensors as JSON lists) posted to /generate as is."""
    from vlmrl.rollout.sglang import SGLangCommon

    request = video_batch(tiny_model_path, 2.0)[0]
    ids, _, entries = SGLangCommon.video_entry(backend, request)
    entry = {key: value.tolist() if hasattr(value, "tolist") else value for key, value in entries[0].items()}
    body = {"input_ids": [ids], "video_data": [[entry]], "return_logprob": True,
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": 1}]}
    with pytest.raises(RolloutError, match="HTTP 400 .*unknown field `format`"):
        backend._post("/generate", body, "generate with processor outputs")
    assert backend.generate(batch[:1], GREEDY)[0].response_ids == hf_greedy[0].response_ids, "still serving"
