"""SGLang HTTP server (launched by vlmrl, fp32, CPU) on the embedded GLM-4.1V against transformers: the shared engine
contract over HTTP (images as data URLs, weight updates from disk).

A variant (marker `full`, make test-all): the server path is the in-process engine's requests over HTTP, which make
test runs on Qwen2.5-VL and Qwen3.5 (tests/rollout/test_sglang_server.py, tests/rollout/qwen3_5), beside GLM-4.1V's
in-process SGLang contract (tests/rollout/glm4v/test_sglang.py); a server start costs 30-40 s."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import EngineContract, sglang_server

pytestmark = [pytest.mark.sglang, pytest.mark.full]


@pytest.fixture(scope="module")
def backend(tiny_model_path, tmp_path_factory):
    yield from sglang_server(tiny_model_path, tmp_path_factory, "sglang-server-glm4v")


class TestSGLangServerGlm4v(EngineContract):
    pass
