"""A server process vlmrl launches and owns: the sglang-server rollout backend's SGLang server and the judge's vLLM
or SGLang server. `python -m MODULE FLAGS --host H --port P` runs in a session of its own (so closing it ends the
server's whole process group and nothing of ours), writes its output to a log file, is ready when /health answers
within a deadline, and is ended with its owner or at exit.

    server = LaunchedServer("sglang.launch_server", flags(args), host="127.0.0.1", port=0, log_file="",
                            log_prefix="vlmrl-sglang-server", env={"SGLANG_USE_CPU_ENGINE": "1"}, name="SGLang server")
    server.wait_ready(600)        # ServerExited / ServerNotReady, each naming the server
    server.url                    # http://127.0.0.1:PORT
    server.close()
"""

from __future__ import annotations

import atexit
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from vlmrl.utils.processes import kill_process_group


class ServerExited(RuntimeError):
    """The server process is gone (the message names its pid and exit code)."""


class ServerNotReady(RuntimeError):
    """The server did not answer /health in time."""


class LaunchedServer:
    """One launched server: `url`, `log_path`, `process`, `exited()`, `wait_ready(timeout_s)`, `close()` (safe to
    call twice; also called at exit)."""

    def __init__(self, module: str, server_flags: list[str], *, host: str, port: int, log_file: str, log_prefix: str,
                 env: Mapping[str, str], name: str):
        self.name = name
        port = port or free_port(host)
        self.url = f"http://{connect_host(host)}:{port}"
        self.log_path = log_file or os.path.join(tempfile.gettempdir(), f"{log_prefix}-{port}.log")
        command = [sys.executable, "-m", module, *server_flags, "--host", host, "--port", str(port)]
        with open(self.log_path, "ab") as log:
            # Own session: close() ends the server's whole process group and nothing of ours.
            self.process: subprocess.Popen | None = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env},
                start_new_session=True)
        self.pid = self.process.pid
        atexit.register(self.close)

    def exited(self) -> str | None:
        """Why the server is gone (its pid and exit code), None while it runs."""
        if self.process is not None and self.process.poll() is not None:
            return f"the {self.name} process (pid {self.pid}) exited with code {self.process.returncode}"
        return None

    def wait_ready(self, timeout_s: float) -> None:
        """Returns once /health answers; ServerExited as soon as the process is gone, ServerNotReady after
        timeout_s."""
        wait_for_health(self.url, timeout_s, self.exited)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.process is not None:
            kill_process_group(self.process, grace_s=15)  # SIGTERM ends either engine's server and children in seconds
            self.process = None


def wait_for_health(url: str, timeout_s: float, exited: Callable[[], str | None] = lambda: None) -> None:
    """Polls `url`/health once a second until it answers 200. Raises ServerExited when `exited()` says why the
    server is gone, ServerNotReady (naming the last connection error) when timeout_s runs out."""
    import requests

    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        problem = exited()
        if problem:
            raise ServerExited(problem)
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException as err:
            last = type(err).__name__
        time.sleep(1.0)
    raise ServerNotReady(f"{url} not ready in time: no answer to /health within {timeout_s:g} s "
                         f"({last or 'not ready'})")


def flags(args: Mapping[str, Any], negate_false: bool = False) -> list[str]:
    """Server flags of keyword arguments: None left out, True a bare flag, dicts and lists as JSON. False is left
    out, or with `negate_false` written `--no-NAME` (vLLM's boolean options take both forms, and some default on).

    >>> flags({"tp_size": 2, "disable_cuda_graph": True, "skip": None, "hf_overrides": {"a": [1]}, "off": False})
    ['--tp-size', '2', '--disable-cuda-graph', '--hf-overrides', '{"a": [1]}']
    >>> flags({"enable_prefix_caching": False}, negate_false=True)
    ['--no-enable-prefix-caching']
    """
    out = []
    for key, value in args.items():
        name = key.replace("_", "-")
        if value is None or (value is False and not negate_false):
            continue
        if value is False:
            out.append(f"--no-{name}")
        elif value is True:
            out.append(f"--{name}")
        else:
            out += [f"--{name}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return out


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_below_ephemeral(low: int = 20000, attempts: int = 64) -> int:
    """A free port under the kernel's ephemeral range (which bind(0) and connect() hand out), drawn with the OS's
    randomness. For a port a child process binds only later (SGLang's nccl_port): SGLang draws it itself with
    Python's global `random`, which a vLLM engine in the same process seeds with the run's seed, so two processes on
    one machine that seeded alike drew the same port and the second engine's scheduler died on EADDRINUSE (measured:
    two pytest workers). Falls back to an ephemeral port where the range below is too small."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    ports = range(low, ephemeral_low)
    if len(ports) < attempts:
        return free_port("0.0.0.0")
    for port in random.SystemRandom().sample(ports, attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    return free_port("0.0.0.0")


def connect_host(host: str) -> str:
    """Where this process reaches a server bound to `host` (a wildcard bind is reached on loopback).

    >>> connect_host("0.0.0.0")
    '127.0.0.1'
    """
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
