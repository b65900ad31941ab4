"""SGLang (in-process, fp32) on the embedded InternVL3.5 against transformers. sglang 0.5.23 serves transformers'
InternVL format only through its Transformers fallback, from chat text: vlmrl sends the request's prompt ids
decoded to text (checked to tokenize back to them) with the images, checks at start that the engine expands a
probe's text into exactly the ids the trainer scores, and checks every prompt's expanded length. Then the shared
engine contract: greedy equal on nine requests, n=4 raw logprobs, pad ban, weight sync, the weight probe."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import EngineContract

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_internvl):
    return sglang_internvl


class TestSGLangInternVL(EngineContract):
    favour_last_positions = True  # as on vLLM (tests/rollout/internvl/test_vllm.py)
