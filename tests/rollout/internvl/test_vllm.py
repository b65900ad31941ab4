"""vLLM (in-process, fp32) on the embedded InternVL3.5 against transformers: the shared engine contract (greedy equal
on nine requests with 0-2 images of 1-5 tiles, n=4 raw logprobs, pad ban, weight sync whole and bucketed under the
checkpoint's names, the weight probe). vLLM runs transformers' InternVL format as its InternS1 model, from the same
request form as every family: one `<IMG_CONTEXT>` per image in the prompt ids, and the images."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import EngineContract

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_internvl):
    return vllm_internvl


class TestVLLMInternVL(EngineContract):
    # an image is 18-82 tokens here: their hidden states outnumber the text's and pull the all-positions mean off the
    # direction that predicts a first token (the pad token then leads on 6 of the 9 prompts at any strength)
    favour_last_positions = True
