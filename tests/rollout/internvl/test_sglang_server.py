"""SGLang HTTP server (launched by vlmrl, fp32, CPU) on the embedded InternVL3.5 against transformers: the text-form
requests over HTTP (`text` with images as data URLs; the start-up expansion check), the shared engine contract, and
weight updates from disk under the checkpoint's names.

A variant (marker `full`, make test-all): the in-process engine's text-form requests are the same payload
(tests/rollout/internvl/test_sglang.py); a server start costs 30-40 s."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import EngineContract, sglang_server

pytestmark = [pytest.mark.sglang, pytest.mark.full]


@pytest.fixture(scope="module")
def backend(tiny_model_path, tmp_path_factory):
    yield from sglang_server(tiny_model_path, tmp_path_factory, "sglang-server-internvl")


class TestSGLangServerInternVL(EngineContract):
    favour_last_positions = True  # as on vLLM (tests/rollout/internvl/test_vllm.py)
