"""SGLang HTTP server backend (launched by vlmrl on 127.0.0.1, fp32, CPU) against the HF reference, with SGLang's
multimodal embedding cache ON (the weight-versioned mm_hashes alone must keep old vision embeddings out: the engine
contract runs on this engine in tests/rollout/test_family_contract.py), a client given the server's URL, and a killed server (last)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.rollout.helpers import GREEDY, greedy_mismatch
from vlmrl.rollout.errors import EngineDeadError, RolloutError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_server_qwen2_5_vl):
    assert sglang_server_qwen2_5_vl.url.startswith("http://127.0.0.1:")
    return sglang_server_qwen2_5_vl


def test_client_of_a_server_given_by_url(backend, tiny_model_path, batch, hf_greedy):
    """rollout.server.url connects to a running server (checking its logprob mode); closing the client leaves it running."""
    with get_backend("sglang-server", tiny_model_path, url=backend.url, max_model_len=1024) as client:
        assert client.engine_pids == []
        results = client.generate(batch, GREEDY)
    problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, "sglang-server"))]
    assert not problems, "\n".join(problems)
    assert backend.generate(batch[:1], GREEDY)[0].response_ids == hf_greedy[0].response_ids


def test_a_server_given_by_url_is_taken_in_the_dtype_it_runs(backend, tiny_model_path):
    """The server's own dtype (/server_info), not the one vlmrl would pick: the client syncs and judges in it, and an
    explicit rollout.dtype the server does not run is refused naming both, before any request."""
    with get_backend("sglang-server", tiny_model_path, url=backend.url, max_model_len=1024) as client:
        assert client.dtype == "float32"
    with pytest.raises(RolloutError, match=r"rollout.dtype=bfloat16, but the server at http://127.0.0.1:\d+ runs "
                                           r".* in float32: restart it with --dtype bfloat16"):
        get_backend("sglang-server", tiny_model_path, url=backend.url, dtype="bfloat16", max_model_len=1024)


@pytest.mark.ends_engine
def test_killed_server_fails_next_call_fast_with_clear_error(backend, tiny_model_path, batch):
    """Killing the server process: the launching backend names the dead process and its log; a client connected
    by URL reports that the server does not answer."""
    client = get_backend("sglang-server", tiny_model_path, url=backend.url, max_model_len=1024)
    pid = backend.engine_pids[0]
    os.kill(pid, signal.SIGKILL)
    backend.process.wait(timeout=30)
    with pytest.raises(EngineDeadError, match=f"^sglang-server: .*pid {pid}.*server log: "):
        backend.generate(batch[:2], GREEDY)
    with pytest.raises(EngineDeadError, match="^sglang-server: .*does not answer"):
        client.generate(batch[:2], GREEDY)
    client.close()


def test_a_server_that_is_not_ready_in_time_is_stopped(tiny_model_path):
    """start_timeout_s runs out while the launched server is still loading: the error says so and the server (in its
    own session, so nothing else would ever stop it) is gone when the error arrives."""
    import psutil

    def servers() -> list[int]:
        return [p.pid for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "sglang.launch_server" in " ".join(p.cmdline()) and p.pid not in before]

    before = set(p.pid for p in psutil.Process().children(recursive=True))
    with pytest.raises(RolloutError, match="sglang-server: .* not ready in time"):
        get_backend("sglang-server", tiny_model_path, max_model_len=1024, start_timeout_s=2)
    assert servers() == []
