"""SGLang Engine (fp32, CPU) on the embedded GLM-4.1V against transformers: the shared engine contract (greedy equal
on nine requests with 0-2 images, n=4 raw logprobs, pad ban, weight sync with salted image hashes)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import EngineContract

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_glm4v):
    return sglang_glm4v


class TestSGLangGlm4v(EngineContract):
    pass
