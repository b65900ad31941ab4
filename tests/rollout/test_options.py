"""Every option of each engine's run-config section reaches that engine's constructor: the arguments vlmrl builds
for vLLM's `LLM(...)` and SGLang's `Engine(...)` / server flags, from a loaded run config (no engine started here;
tests/rollout/test_memory_release.py and the engine modules start them with these arguments)."""

from __future__ import annotations

import os

import pytest

from vlmrl.config import load_config
from vlmrl.models.families import QWEN2_5_VL
from vlmrl.rollout.base import BackendOptions
from vlmrl.rollout.registry import backend_options

BASE = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
        "data.max_prompt_length=200", "data.max_response_length=56", "trainer.seed=11"]


def options(name: str, *overrides: str, colocated: bool = False) -> BackendOptions:
    config = load_config([*BASE, f"rollout.name={name}", *overrides], check_model=False)
    return backend_options(config.rollout, name, max_model_len=config.derived.max_model_len, seed=config.trainer.seed,
                           lora=config.actor.lora, colocated=colocated)


def vllm_args(*overrides: str, on_cuda: bool = False, colocated: bool = False, model_path: str = "m"):
    from vlmrl.rollout.vllm import engine_kwargs

    return engine_kwargs(model_path, options("vllm", *overrides, colocated=colocated), QWEN2_5_VL, on_cuda)


def sglang_args(*overrides: str, on_cuda: bool = False, colocated: bool = False, model_path: str = "m"):
    from vlmrl.rollout.sglang import engine_args

    return engine_args(model_path, options("sglang", *overrides, colocated=colocated), QWEN2_5_VL, on_cuda, "sglang")


def test_every_vllm_option_reaches_its_constructor(tiny_model_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    kwargs, env = vllm_args("rollout.dtype=bfloat16", "rollout.limit_images=3", "rollout.limit_videos=2",
                            "rollout.gpu_memory_utilization=0.45", "rollout.tensor_parallel_size=2",
                            "trainer.n_gpus_per_node=2",
                            "rollout.vllm.enforce_eager=false", "rollout.vllm.max_num_batched_tokens=40000",
                            "rollout.vllm.enable_prefix_caching=false", "rollout.vllm.enable_sleep_mode=true",
                            "rollout.vllm.cpu_kv_cache_gb=3", "rollout.vllm.multiprocess=true",
                            "rollout.vllm.engine_kwargs={max_num_seqs: 7}", model_path=tiny_model_path)
    assert (kwargs["dtype"], kwargs["max_model_len"], kwargs["seed"]) == ("bfloat16", 256, 11)
    assert kwargs["limit_mm_per_prompt"] == {"image": 3, "video": 2}
    assert (kwargs["gpu_memory_utilization"], kwargs["tensor_parallel_size"]) == (0.45, 2)
    assert (kwargs["enforce_eager"], kwargs["max_num_batched_tokens"], kwargs["enable_prefix_caching"]) == (
        False, 40000, False)
    assert kwargs["enable_sleep_mode"] is True and kwargs["max_num_seqs"] == 7
    # an engine of its own at TP 2 (a rollout worker's; a training worker sets spmd for its colocated rank): vLLM's
    # multiprocess executor, each TP rank's CPU cores named
    from vlmrl.rollout.config import even_binding

    assert kwargs["distributed_executor_backend"] == "mp"
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "3",
                   "VLLM_CPU_OMP_THREADS_BIND": even_binding(2, os.cpu_count() or 1)}
    # what the engine contract fixes, whatever the config says
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["mm_processor_kwargs"] == {"do_sample_frames": False}


def test_vllm_defaults_follow_the_device(tiny_model_path):
    cpu, _ = vllm_args(model_path=tiny_model_path)
    assert cpu["enforce_eager"] is True and cpu["enable_sleep_mode"] is False
    assert cpu["max_num_batched_tokens"] == 16384
    gpu, _ = vllm_args(on_cuda=True, colocated=True, model_path=tiny_model_path)
    assert gpu["enforce_eager"] is False and gpu["enable_sleep_mode"] is True, "colocated on a GPU: sleep mode on"
    alone, _ = vllm_args(on_cuda=True, model_path=tiny_model_path)
    assert alone["enable_sleep_mode"] is False, "validate-only / compare engines keep their memory"
    off, _ = vllm_args("rollout.vllm.enable_sleep_mode=false", on_cuda=True, colocated=True, model_path=tiny_model_path)
    assert off["enable_sleep_mode"] is False
    short, _ = vllm_args("rollout.vllm.max_num_batched_tokens=16", model_path=tiny_model_path)
    assert short["max_num_batched_tokens"] == 256, "never below the longest request"


def test_a_lora_run_starts_vllm_to_serve_its_adapters(tiny_model_path):
    kwargs, _ = vllm_args("actor.lora.rank=12", "actor.lora.vision=merger", model_path=tiny_model_path)
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["enable_tower_connector_lora"]) == (True, 16, True)
    merged, _ = vllm_args("actor.lora.rank=12", "actor.lora.sync=merged", model_path=tiny_model_path)
    assert "enable_lora" not in merged


def test_every_sglang_option_reaches_its_constructor(tiny_model_path):
    args = sglang_args("rollout.dtype=bfloat16", "rollout.gpu_memory_utilization=0.45", "rollout.tensor_parallel_size=2",
                       "trainer.n_gpus_per_node=2",
                       "rollout.sglang.max_total_tokens=5000", "rollout.sglang.attention_backend=fa3",
                       "rollout.sglang.enable_memory_saver=true", "rollout.sglang.log_level=warning",
                       "rollout.sglang.engine_kwargs={chunked_prefill_size: 512}", on_cuda=True,
                       model_path=tiny_model_path)
    assert (args["dtype"], args["context_length"], args["random_seed"]) == ("bfloat16", 256, 11)
    assert (args["mem_fraction_static"], args["tp_size"], args["max_total_tokens"]) == (0.45, 2, 5000)
    assert (args["attention_backend"], args["enable_memory_saver"], args["log_level"]) == ("fa3", True, "warning")
    assert args["chunked_prefill_size"] == 512


def test_sglang_defaults_follow_the_device(tiny_model_path, monkeypatch):
    from vlmrl.rollout.sglang import engine_env

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    cpu = sglang_args(model_path=tiny_model_path)
    assert (cpu["device"], cpu["attention_backend"], cpu["max_total_tokens"]) == ("cpu", "torch_native", 8192)
    assert cpu["enable_memory_saver"] is False
    assert cpu["sleep_on_idle"] is True and "sleep_on_idle" not in sglang_args(on_cuda=True, model_path=tiny_model_path)
    assert sglang_args(on_cuda=True, colocated=True, model_path=tiny_model_path)["enable_memory_saver"] is True
    assert sglang_args(on_cuda=True, model_path=tiny_model_path)["enable_memory_saver"] is False
    env = engine_env(options("sglang", "rollout.sglang.vlm_cache_size_mb=64"), on_cuda=False)
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_VLM_CACHE_SIZE_MB": "64",
                   "SGLANG_USE_CPU_ENGINE": "1"}
    assert "SGLANG_USE_CPU_ENGINE" not in engine_env(options("sglang"), on_cuda=True)


def test_the_engines_take_their_cpu_settings_themselves_and_an_explicit_environment_wins(tiny_model_path,
                                                                                          monkeypatch):
    """No exported variables needed on a CPU: vLLM in-process with its KV cache, SGLang's CPU switch. A variable the
    environment sets is left to it; rollout.vllm.multiprocess, when set, decides over it."""
    from vlmrl.rollout.registry import cpu_env
    from vlmrl.rollout.sglang import engine_env

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    assert vllm_args(model_path=tiny_model_path)[1] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                        "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_args(on_cuda=True, model_path=tiny_model_path)[1] == {}, "on CUDA vLLM's own defaults"
    assert engine_env(options("sglang"), on_cuda=False)["SGLANG_USE_CPU_ENGINE"] == "1"
    # what compare puts in the environment of a side process that will start the backend (on a machine without GPU)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    rollout = options("vllm").rollout
    assert cpu_env(rollout, "vllm") == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert cpu_env(rollout, "sglang-server") == {"SGLANG_USE_CPU_ENGINE": "1"} and cpu_env(rollout, "hf") == {}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert vllm_args(model_path=tiny_model_path)[1] == {}
    assert "SGLANG_USE_CPU_ENGINE" not in engine_env(options("sglang"), on_cuda=False)
    told = vllm_args("rollout.vllm.multiprocess=false", model_path=tiny_model_path)[1]
    assert told == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "the config's explicit setting decides"


def test_the_server_flags_carry_the_sglang_section():
    from vlmrl.utils.servers import flags

    assert flags({"tp_size": 2, "disable_cuda_graph": True, "enable_memory_saver": False, "max_total_tokens": None,
                  "host": "127.0.0.1"}) == ["--tp-size", "2", "--disable-cuda-graph", "--host", "127.0.0.1"]


def test_flat_keywords_are_split_between_the_sections():
    o = BackendOptions.from_kwargs("sglang-server", {"dtype": "float32", "max_total_tokens": 99, "url": "http://h:1",
                                                     "port": 31000, "max_model_len": 64, "colocated": True})
    assert (o.rollout.dtype, o.rollout.sglang.max_total_tokens, o.rollout.server.url, o.rollout.server.port) == (
        "float32", 99, "http://h:1", 31000)
    assert (o.max_model_len, o.colocated) == (64, True)
    with pytest.raises(TypeError, match=r"sglang: unknown option\(s\) \['enforce_eager'\]"):
        BackendOptions.from_kwargs("sglang", {"enforce_eager": True})  # vLLM's
    with pytest.raises(TypeError, match=r"hf: unknown option\(s\) \['gpu_memory_utilization'\]"):
        BackendOptions.from_kwargs("hf", {"gpu_memory_utilization": 0.5})  # the serving engines'


@pytest.mark.parametrize("key, message", [
    ("rollout.vllm.sleep_level=3", "rollout.vllm.sleep_level=3 must be 1"),
    ("rollout.sglang.log_level=loud", "rollout.sglang.log_level='loud' is not one of"),
    ("rollout.server.url=10.0.0.5:30000", "rollout.server.url='10.0.0.5:30000' must start with http"),
    ("rollout.sglang.vlm_cache_size_mb=-1", "rollout.sglang.vlm_cache_size_mb=-1 must be >= 0"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=1.5 must be in (0, 1]"),
])
def test_bad_engine_options_are_refused_at_load(key, message):
    from vlmrl.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config([*BASE, key], check_model=False)


def test_sleep_level_two_cannot_serve_a_lora_adapter():
    from vlmrl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.vllm.sleep_level=2 drops the base weights"):
        load_config([*BASE, "actor.lora.rank=8", "rollout.vllm.sleep_level=2"], check_model=False)
    load_config([*BASE, "actor.lora.rank=8", "actor.lora.sync=merged", "rollout.vllm.sleep_level=2"],
                check_model=False)


def test_routing_capture_starts_each_engine_with_its_own_capture_on_a_gpu_only(tmp_path):
    """rollout.*.capture_routing on a MoE model: on a GPU both engines start with their own capture
    (`enable_return_routed_experts`); on a CPU vLLM starts without it (vlmrl hooks its routers, one sample at a time)
    and SGLang is refused before it starts, naming the way that works on a CPU. On a dense model, which routes
    through no experts, both are refused before they start, naming the key (it captured nothing before)."""
    from vlmrl.models.families import QWEN3_VL_MOE
    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.errors import EngineSettingError
    from vlmrl.rollout.sglang import engine_args
    from vlmrl.rollout.vllm import engine_kwargs

    path = str(ensure_built("tiny-qwen3-vl-moe"))
    vllm_on = options("vllm", "rollout.vllm.capture_routing=true")
    assert engine_kwargs(path, vllm_on, QWEN3_VL_MOE, on_cuda=True)[0]["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_kwargs(path, vllm_on, QWEN3_VL_MOE, on_cuda=False)[0]
    assert "enable_return_routed_experts" not in engine_kwargs(path, options("vllm"), QWEN3_VL_MOE, True)[0]
    for on_cuda in (True, False):
        with pytest.raises(EngineSettingError, match="vllm: rollout.vllm.capture_routing=true records .* Qwen2.5-VL "
                                                     "is a dense model"):
            engine_kwargs(path, vllm_on, QWEN2_5_VL, on_cuda)
    sglang_on = options("sglang", "rollout.sglang.capture_routing=true")
    assert engine_args(path, sglang_on, QWEN3_VL_MOE, True, "sglang")["enable_return_routed_experts"] is True
    with pytest.raises(ValueError, match="capture_routing needs a GPU.*rollout.vllm.capture_routing=true"):
        engine_args(path, sglang_on, QWEN3_VL_MOE, False, "sglang")
    assert "enable_return_routed_experts" not in engine_args(path, options("sglang"), QWEN3_VL_MOE, True, "sglang")
    with pytest.raises(EngineSettingError, match="sglang-server: rollout.sglang.capture_routing=true .* dense"):
        engine_args(path, sglang_on, QWEN2_5_VL, True, "sglang-server")
