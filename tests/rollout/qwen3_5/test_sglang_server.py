"""SGLang HTTP server (launched by vlmrl, bfloat16, CPU) on the embedded Qwen3.5 against transformers in bfloat16:
the family's CPU settings as server flags, and a server given by URL that
runs a config without what SGLang reads is refused, naming the flag to restart it with."""

from __future__ import annotations

import json

import pytest

from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.registry import get_backend

# The whole module is a variant (marker `full`, make test-all; its server start alone takes 31-38 s on 2 cores): the
# launched SGLang server on Qwen3.5. make test keeps Qwen3.5's contract on vLLM and on in-process SGLang (with the
# family's CPU settings, tests/rollout/qwen3_5/test_sglang.py), the server path's contract on Qwen2.5-VL
# (tests/rollout/test_family_contract.py), and what a config lacks read
# from it as engine settings (tests/rollout/test_base.py).
pytestmark = [pytest.mark.sglang, pytest.mark.full]


@pytest.fixture(scope="module")
def backend(sglang_server_qwen3_5):
    return sglang_server_qwen3_5


def test_the_server_runs_with_the_familys_flags(backend):
    """`--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule` reached the server (its /server_info)."""
    import requests

    info = requests.get(f"{backend.url}/server_info", timeout=30).json()
    assert info["mamba_radix_cache_strategy"] == "no_buffer" and info["disable_overlap_schedule"] is True
    assert info["dtype"] == "bfloat16"


def test_a_server_on_a_misset_config_is_refused_unless_told(backend, misset_config_path, tmp_path, capsys):
    """A server given by URL that was not told mrope_interleaved, for a config that lacks it, is refused by a default
    client, naming --json-model-override-args with what it lacks; `compare` on it exits 2 with that message in the
    side's log. The client decides from two things only: its model's config.json and the override arguments the server
    reports (/server_info). So the module's server stands in for one started on the copy without the key
    (family_engine_settings=false, as a deployment outside vlmrl would; it starts, then computes another model): it
    was told no mrope_interleaved either (its own config.json has it), and the client is given the copy. (In bfloat16
    the diff itself cannot tell this engine from a correct one on the tiny model: see
    tests/alignment/test_compare_families.py, its Qwen3.5 line. Without full_attention_interval or deepstack_visual_indexes such
    a server does not even start or serve an image. A server launched on a config without the key, then refused, is
    the `full` variant in tests/rollout/qwen3_vl/test_sglang_server.py.)"""
    import requests

    from vlmrl.alignment.compare import main

    told = json.loads(requests.get(f"{backend.url}/server_info", timeout=30).json().get("json_model_override_args")
                      or "{}")
    assert "mrope_interleaved" not in json.dumps(told), told  # what a server on the copy would report too
    with pytest.raises(RolloutError, match="sglang-server: the server at .*mrope_interleaved.*"
                                           "--json-model-override-args"):
        get_backend("sglang-server", misset_config_path, url=backend.url, max_model_len=1024)
    out = tmp_path / "compare"
    status = main(["--backends", "sglang-server,hf", f"actor.model_path={misset_config_path}",
                   "data.val_files=synthetic", "data.train_files=synthetic", "data.synthetic_val_size=2",
                   "data.max_response_length=4", "rollout.dtype=bfloat16", f"rollout.server.url={backend.url}",
                   f"trainer.output_dir={tmp_path / 'runs'}", "--out", str(out), "--no-html"])
    assert status == 2 and "val_a_sglang-server.log" in "".join(capsys.readouterr().err.split())
    assert "--json-model-override-args" in (out / "val_a_sglang-server.log").read_text()
