"""A launched SGLang HTTP server (float32, CPU) on the embedded Qwen3-VL-MoE: greedy == HF token for token, and the
expert sync (safetensors shards on disk, in the hub's layout) lands."""

from __future__ import annotations

import pytest

from tests.moe.contract import Qwen3VLMoEContract
from tests.rollout.helpers import sglang_server

# The module is a variant (marker `full`, make test-all; its server start alone takes 30-40 s on 2 cores): the MoE
# model through the launched server. make test keeps Qwen3-VL-MoE's contract on in-process SGLang (the same engine
# code and the same update_weights_from_tensor loader, tests/moe/test_qwen3_vl_moe_sglang.py) and the server's own
# sync path (safetensors shards on disk) on the dense families (tests/rollout/test_sglang_server.py).
pytestmark = [pytest.mark.sglang, pytest.mark.full]


@pytest.fixture(scope="module")
def backend(qwen3_vl_moe_path, tmp_path_factory):
    yield from sglang_server(qwen3_vl_moe_path, tmp_path_factory, "sglang-server-qwen3-vl-moe")


class TestSGLangServerQwen3VLMoE(Qwen3VLMoEContract):
    pass

    # the per-kind pushes are the in-process engine's test (the same update path in SGLang); here the rolled
    # experts, bucketed, through the server's disk shards
    test_every_kind_of_moe_tensor_lands = None
