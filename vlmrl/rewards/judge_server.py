"""The judge server vlmrl launches (reward.judge.server, when reward.judge.url is empty): an OpenAI-compatible SGLang
or vLLM server in a process group of its own, on loopback unless told otherwise, with its output in a log file,
ready when /health answers, ended (SIGTERM, then SIGKILL) with the run.

    server = launch_judge_server(config.reward.judge.server, seed=0, top_logprobs=20)
    server.url            # http://127.0.0.1:PORT, the base of /v1/chat/completions
    server.close()

On CPU it runs as the rollout engines do there (docs/engines.md): SGLang with SGLANG_USE_CPU_ENGINE=1, --device cpu,
torch_native attention, no CUDA graphs and an 8192-token KV cache; vLLM eager with a 1 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE, unless set). The vLLM server returns logprobs after logit processing
(--logprobs-mode processed_logprobs), what the judge's constrained logprobs mode reads.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from vlmrl.rewards.config import JudgeServerConfig
from vlmrl.utils.processes import kill_process_group

logger = logging.getLogger(__name__)

CPU_KV_TOKENS = 8192
"""SGLang's KV cache on CPU (without a bound it allocates ~6 GB)."""


class JudgeServerError(RuntimeError):
    """The judge server did not start (the message names its log file)."""


class JudgeServer:
    """A launched judge server: `url`, `log_path`, `close()` (safe to call twice)."""

    def __init__(self, config: JudgeServerConfig, *, seed: int = 0, top_logprobs: int = 20):
        from vlmrl.models.tiny import resolve_model_path

        self.config = config
        self.model_path = str(resolve_model_path(config.model_path))
        port = config.port or _free_port(config.host)
        self.url = f"http://{_connect_host(config.host)}:{port}"
        self.log_path = config.log_file or os.path.join(tempfile.gettempdir(), f"vlmrl-judge-{port}.log")
        on_cuda = _on_cuda(config)
        if on_cuda and not config.cuda_visible_devices:
            logger.warning("judge: the server starts on the GPU(s) this process sees, taking %.0f%% of their memory "
                           "beside the rollout engine and the actor: give it its own with "
                           "reward.judge.server.cuda_visible_devices (or lower server.gpu_memory_utilization)",
                           100 * config.gpu_memory_utilization)
        command = [sys.executable, "-m", *server_command(config, self.model_path, port, seed=seed,
                                                          top_logprobs=top_logprobs, on_cuda=on_cuda)]
        env = {**os.environ, **server_env(config, on_cuda)}
        with open(self.log_path, "ab") as log:
            # Own session: close() ends the server's whole process group and nothing of ours.
            self.process: subprocess.Popen | None = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        atexit.register(self.close)
        logger.info("judge: launching a %s server on %s for %s (pid %d, log %s)", config.engine, self.url,
                    self.model_path, self.process.pid, self.log_path)
        try:
            self._wait_ready(time.monotonic() + config.start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, deadline: float) -> None:
        import requests

        began, last = time.monotonic(), ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise JudgeServerError(f"the judge server (pid {self.process.pid}) exited with code "
                                       f"{self.process.returncode} while starting; its log: {self.log_path}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    logger.info("judge: server ready on %s after %.0f s", self.url, time.monotonic() - began)
                    return
            except requests.RequestException as err:
                last = type(err).__name__
            time.sleep(1.0)
        raise JudgeServerError(f"the judge server on {self.url} did not answer /health within "
                               f"{self.config.start_timeout_s:g} s ({last or 'not ready'}; raise "
                               f"reward.judge.server.start_timeout_s for a large model); its log: {self.log_path}")

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.process is not None:
            kill_process_group(self.process, grace_s=15)  # SIGTERM ends either server and its children in seconds
            self.process = None


def launch_judge_server(config: JudgeServerConfig, *, seed: int = 0, top_logprobs: int = 20) -> JudgeServer:
    """Launch the judge server and wait until it answers (JudgeServerError naming its log when it does not)."""
    return JudgeServer(config, seed=seed, top_logprobs=top_logprobs)


def server_command(config: JudgeServerConfig, model_path: str, port: int, *, seed: int, top_logprobs: int,
                   on_cuda: bool) -> list[str]:
    """The module and flags that start the server (after `python -m`). Pure, so a config can be checked without
    starting anything.

    >>> server_command(JudgeServerConfig(engine="vllm"), "/m", 8000, seed=0, top_logprobs=20, on_cuda=False)[:3]
    ['vllm.entrypoints.openai.api_server', '--model', '/m']
    """
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    common = {"host": config.host, "port": port, "dtype": dtype}
    if config.engine == "sglang":
        args: dict[str, Any] = {"model_path": model_path, **common, "context_length": config.max_model_len,
                                "random_seed": seed, "log_level": "error"}
        if on_cuda:
            args["mem_fraction_static"] = config.gpu_memory_utilization
        else:
            args.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                        max_total_tokens=CPU_KV_TOKENS)
        module = "sglang.launch_server"
    else:
        args = {"model": model_path, **common, "max_model_len": config.max_model_len, "seed": seed,
                "max_logprobs": max(top_logprobs, 20), "logprobs_mode": "processed_logprobs"}
        if on_cuda:
            args["gpu_memory_utilization"] = config.gpu_memory_utilization
        else:
            args["enforce_eager"] = True
        module = "vllm.entrypoints.openai.api_server"
    args.update(config.args)
    return [module, *_flags(args)]


def server_env(config: JudgeServerConfig, on_cuda: bool) -> dict[str, str]:
    """Environment the server starts with, over this process's."""
    env = {}
    if config.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
    if not on_cuda and config.engine == "sglang":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # the only switch that makes device=cpu take SGLang's CPU code paths
    if not on_cuda and config.engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # else start-up fails
    return env


def _on_cuda(config: JudgeServerConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    import torch

    return torch.cuda.is_available()


def _flags(args: dict[str, Any]) -> list[str]:
    """{"tp_size": 2, "enforce_eager": True} -> ["--tp-size", "2", "--enforce-eager"] (None / False left out).

    >>> _flags({"tp_size": 2, "enforce_eager": True, "skip": False})
    ['--tp-size', '2', '--enforce-eager']
    """
    out = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _connect_host(host: str) -> str:
    """Where this process reaches a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
