"""The judge server vlmrl launches (reward.judge.server, when reward.judge.url is empty): an OpenAI-compatible SGLang
or vLLM server, started as the rollout engines start (`vlmrl.rollout.sglang.engine_args`,
`vlmrl.rollout.vllm.engine_kwargs`: the CPU settings, and the model family's settings where its config.json lacks
them) and run by `vlmrl.utils.servers.LaunchedServer` (its own process group, a log file, ready when /health
answers, ended with the run).

    server = launch_judge_server(config.reward.judge.server, seed=0, top_logprobs=20)
    server.url            # http://127.0.0.1:PORT, the base of /v1/chat/completions
    server.close()

What differs from a rollout engine: the judge reads logprobs after logit processing (vLLM `--logprobs-mode
processed_logprobs`, SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB), which its constrained logprobs mode needs; it
loads no weights after start-up; and any model a server serves may judge (a model of no family vlmrl knows starts as
its config.json says).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vlmrl.models.families import ModelFamily, family_for_path
from vlmrl.rewards.config import JudgeServerConfig
from vlmrl.utils.servers import LaunchedServer, ServerExited, ServerNotReady, flags

logger = logging.getLogger(__name__)

MODULES = {"sglang": "sglang.launch_server", "vllm": "vllm.entrypoints.openai.api_server"}
"""The module each engine's OpenAI-compatible server runs as (`python -m ...`)."""


class JudgeServerError(RuntimeError):
    """The judge server did not start (the message names its log file)."""


def launch_judge_server(config: JudgeServerConfig, *, seed: int = 0, top_logprobs: int = 20) -> LaunchedServer:
    """Launch the judge server and wait until it answers (JudgeServerError naming its log when it does not)."""
    from vlmrl.models.tiny import resolve_model_path

    model_path = str(resolve_model_path(config.model_path))
    on_cuda = _on_cuda(config)
    if on_cuda and not config.cuda_visible_devices:
        logger.warning("judge: the server starts on the GPU(s) this process sees, taking %.0f%% of their memory "
                       "beside the rollout engine and the actor: give it its own with "
                       "reward.judge.server.cuda_visible_devices (or lower server.gpu_memory_utilization)",
                       100 * config.gpu_memory_utilization)
    module, server_flags, env = server_command(config, model_path, seed=seed, top_logprobs=top_logprobs,
                                               on_cuda=on_cuda)
    http = config.http
    server = LaunchedServer(module, server_flags, host=http.host, port=http.port, log_file=http.log_file,
                            log_prefix="vlmrl-judge", env=env, name="judge server")
    logger.info("judge: launching a %s server on %s for %s (pid %d, log %s)", config.engine, server.url, model_path,
                server.pid, server.log_path)
    began = time.monotonic()
    try:
        server.wait_ready(config.start_timeout_s)
    except ServerExited as err:
        server.close()
        raise JudgeServerError(f"{err} while starting; its log: {server.log_path}") from None
    except ServerNotReady as err:
        server.close()
        raise JudgeServerError(f"the judge server on {err} (raise reward.judge.server.start_timeout_s for a large "
                               f"model); its log: {server.log_path}") from None
    except BaseException:
        server.close()
        raise
    logger.info("judge: server ready on %s after %.0f s", server.url, time.monotonic() - began)
    return server


def server_command(config: JudgeServerConfig, model_path: str, *, seed: int, top_logprobs: int, on_cuda: bool
                   ) -> tuple[str, list[str], dict[str, str]]:
    """(module to run with `python -m`, its flags but --host / --port, environment over this process's) of the
    judge server: the engine's own arguments for the judge's options, then what the judge reads. Pure, so a config
    can be checked without starting anything.

    >>> module, server_flags, _ = server_command(JudgeServerConfig(engine="vllm"), "/m", seed=0, top_logprobs=20,
    ...                                          on_cuda=False)
    >>> module, server_flags[:2]
    ('vllm.entrypoints.openai.api_server', ['--model', '/m'])
    """
    from vlmrl.rollout.base import BackendOptions
    from vlmrl.rollout.config import RolloutConfig

    family = _family(model_path)
    rollout = RolloutConfig(dtype=config.dtype, gpu_memory_utilization=config.gpu_memory_utilization,
                            start_timeout_s=config.start_timeout_s, sglang=config.sglang, vllm=config.vllm)
    options = BackendOptions(rollout=rollout, max_model_len=config.max_model_len, seed=seed)
    # the judge's device decides `auto`, not whether this process sees a GPU
    rollout.dtype = options.resolved_dtype(family, on_cuda)
    env = {"CUDA_VISIBLE_DEVICES": config.cuda_visible_devices} if config.cuda_visible_devices else {}
    if config.engine == "sglang":
        from vlmrl.rollout.sglang import engine_args, server_env, with_own_nccl_port

        args = with_own_nccl_port(engine_args(model_path, options, family, on_cuda, "sglang"))
        return MODULES["sglang"], flags(args), {**server_env(config.sglang, on_cuda), **env}
    from vlmrl.rollout.vllm import engine_kwargs

    args, engine_env = engine_kwargs(model_path, options, family, on_cuda)
    judge: dict[str, Any] = {
        "logprobs_mode": "processed_logprobs",  # after the logit bias, which `constrain` reads
        "max_logprobs": max(top_logprobs, 20),
        "worker_extension_cls": None,  # the judge's weights never change
        "limit_mm_per_prompt": None,  # a request carries the row's images and video frames: vLLM's own limits
        "mm_processor_kwargs": None,  # for the rollout's videos; the judge sees frames as images
    }
    args.update({key: value for key, value in judge.items() if key not in config.vllm.engine_kwargs})
    # vLLM's boolean options take --no-NAME, and some default on (enable_prefix_caching)
    return MODULES["vllm"], flags(args, negate_false=True), {**engine_env, **env}


def _family(model_path: str) -> ModelFamily | None:
    """The judge model's family when vlmrl knows it (a local folder of a supported model), else None."""
    try:
        return family_for_path(model_path)
    except (FileNotFoundError, ValueError):
        return None


def _on_cuda(config: JudgeServerConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    import torch

    return torch.cuda.is_available()
