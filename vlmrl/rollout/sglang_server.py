"""The `sglang-server` backend: HTTP to an SGLang server vlmrl launches (on rollout.server.host, 127.0.0.1 unless
told otherwise) or one the user runs (rollout.server.url). It builds requests and reads results as the in-process
Engine does (`vlmrl.rollout.sglang`), sends images as lossless PNG data URLs, and syncs weights as safetensors
shards written atomically to a private folder and loaded with `/update_weights_from_disk` (no pickled payloads over
HTTP). Video requests are refused: over HTTP SGLang takes a video only as a file, from which it cannot compute what
transformers computes (docs/engines.md, "sglang-server and videos").
"""

from __future__ import annotations

import atexit
import base64
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from vlmrl.models.families import read_model_config
from vlmrl.rollout.base import BackendOptions, DeadlineRunner, merged
from vlmrl.rollout.errors import EngineDeadError, InvalidRequestError, RolloutError
from vlmrl.rollout.sglang import SGLangCommon, engine_env
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.processes import kill_process_group

logger = logging.getLogger(__name__)


class SGLangServerBackend(SGLangCommon):
    """HTTP client of an SGLang server: one vlmrl launches (`python -m sglang.launch_server` on rollout.server.host,
    a free port, its own log file) or one the user runs (rollout.server.url)."""

    name = "sglang-server"

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        self.process: subprocess.Popen | None = None
        self.log_path = ""
        self.weights_dir = Path(tempfile.mkdtemp(prefix="vlmrl-sglang-weights-"))
        self._runner = DeadlineRunner(self.name, self._health)
        try:
            server = self.rollout.server
            if server.url:
                self.url = server.url.rstrip("/")
                # the user says how the server runs; vlmrl cannot tell whether its weights are backed up
                self.memory_saver = bool(self.rollout.sglang.enable_memory_saver)
                self._runner.call("reach the server", lambda: self._wait_ready(deadline=time.monotonic() + 30),
                                  self.rollout.start_timeout_s)
                self._check_server_settings()
                if not self.salt_mm_hashes:
                    logger.warning("%s: %s images carry no salted mm_hashes (SGLang crashes on them): the server at "
                                   "%s must run with SGLANG_VLM_CACHE_SIZE_MB=0, else after a weight sync it serves "
                                   "features of the old vision weights", self.name, self.processor.family.name,
                                   self.url)
            else:
                self.url = self._launch()
            atexit.register(self.close)
            self.check_raw_logprobs(lambda body: self._post("/generate", body, "probe"))
        except BaseException:
            self.close()  # a server that was launched but never became ready would otherwise run on, unowned
            raise

    def _launch(self) -> str:
        server = self.rollout.server
        port = server.port or _free_port(server.host)
        args = {**self.start_args(), "host": server.host, "port": port}
        command = [sys.executable, "-m", "sglang.launch_server", *_flags(args)]
        self.log_path = server.log_file or os.path.join(tempfile.gettempdir(), f"vlmrl-sglang-server-{port}.log")
        with open(self.log_path, "ab") as log:
            # Own session: close() can end the server's whole process group without touching ours.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **engine_env(self.options, self.on_cuda)},
                                            start_new_session=True)
        self.engine_pids = [self.process.pid]
        url = f"http://{_connect_host(server.host)}:{port}"
        logger.info("sglang-server: launching pid %d on %s (log %s)", self.process.pid, url, self.log_path)
        self.url = url
        deadline = self.rollout.start_timeout_s
        self._runner.call("start the server", lambda: self._wait_ready(time.monotonic() + deadline), deadline + 5)
        return url

    def _wait_ready(self, deadline: float) -> None:
        import requests

        last = ""
        while time.monotonic() < deadline:
            problem = self._health()
            if problem:
                raise EngineDeadError(f"{self.name}: {problem}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException as err:
                last = f"{type(err).__name__}"
            time.sleep(1.0)
        raise RolloutError(f"{self.name}: {self.url} not ready in time ({last}){self._log_hint()}")

    def _check_server_settings(self) -> None:
        """A server vlmrl did not start must have been started with what the family needs where config.json lacks
        it (`--json-model-override-args`, read back from /server_info): otherwise it would agree with nothing the
        trainer computes, silently. Refused unless family_engine_settings=false."""
        import requests

        model_config = read_model_config(self.model_path)
        if not self.rollout.family_engine_settings or not self.processor.family.engine_overrides(model_config):
            return
        info = self._runner.call("read the server's settings",
                                 lambda: requests.get(f"{self.url}/server_info", timeout=30), self.rollout.timeout_s)
        if info.status_code != 200:
            raise RolloutError(f"{self.name}: GET {self.url}/server_info: HTTP {info.status_code}: cannot check the "
                               "server's engine settings")
        given = json.loads(info.json().get("json_model_override_args") or "{}")
        problems = self.processor.family.engine_problems(merged(model_config, given))
        if problems:
            needed = json.dumps(self.processor.family.engine_overrides(model_config))
            raise RolloutError(
                f"{self.name}: the server at {self.url} runs {self.model_path} without the settings that make it "
                f"compute what transformers computes: {' '.join(problems)} Restart it with "
                f"--json-model-override-args '{needed}' (or fix config.json), let vlmrl launch the server (empty "
                "rollout.server.url), or set rollout.family_engine_settings=false to accept the drift")

    def _health(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            return (f"the SGLang server process (pid {self.process.pid}) exited with code "
                    f"{self.process.returncode}{self._log_hint()}")
        return None

    def _log_hint(self) -> str:
        return f"; server log: {self.log_path}" if self.log_path else ""

    def _post(self, route: str, body: dict, what: str) -> Any:
        import requests

        def run() -> Any:
            try:
                response = requests.post(self.url + route, json=body, timeout=self.rollout.timeout_s)
            except requests.ConnectionError as err:
                raise EngineDeadError(f"{self.name}: {what}: the server at {self.url} does not answer "
                                      f"({type(err).__name__}){self._log_hint()}") from err
            if response.status_code != 200:
                raise RolloutError(f"{self.name}: {what}: HTTP {response.status_code} from {route}: "
                                   f"{response.text[:500]}")
            return response.json()

        return self._runner.call(what, run, self.rollout.timeout_s)

    def encode_images(self, images: Sequence[Any]) -> list[Any]:
        return [_data_url(im) for im in images]

    def video_entry(self, request: RolloutRequest) -> tuple[list[int], list[Any], list[Any]]:
        raise InvalidRequestError(f"{self.name}: request {request.uid} holds {len(request.videos)} video(s): over "
                                  "HTTP SGLang takes a video only as a file (no processor outputs), and from a file "
                                  "its Qwen2.5-VL path reads every video as 24 fps, resizes by server-wide settings "
                                  "and attends across temporal patches, unlike transformers (see vlmrl.rollout."
                                  "sglang); use the sglang (Engine), vllm or hf backend")

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        outputs = self._post("/generate", self.payload(requests, sampling), f"generate {len(requests)} requests")
        return self.parse(outputs, requests, sampling)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        from safetensors.torch import save_file

        sync = self.sync_plan(named_tensors, names)
        written = set()
        for number, bucket in enumerate(sync.buckets):
            # one shard file per bucket: this process holds one bucket; the server reads the folder's shards
            target = self.weights_dir / f"bucket-{number:05d}.safetensors"
            partial = self.weights_dir / f".bucket-{number:05d}.partial"
            save_file(bucket, str(partial))
            os.replace(partial, target)  # the server never reads a half-written file
            written.add(target.name)
            del bucket
        for stale in self.weights_dir.glob("*.safetensors"):  # shards of an earlier, larger sync
            if stale.name not in written:
                stale.unlink()
        reply = self._post("/update_weights_from_disk", {"model_path": str(self.weights_dir)}, "update weights")
        if not reply.get("success", False):
            raise RolloutError(f"{self.name}: update_weights_from_disk refused: {reply.get('message')}")
        self._flush()  # the update flushes too, but refuses quietly while requests run
        self.weight_version += 1
        logger.debug("sglang-server: loaded %d tensors in %d shard(s) (weight version %d)", len(sync.names),
                     len(written), self.weight_version)

    def _flush(self) -> None:
        import requests

        # /flush_cache answers plain text, not JSON.
        response = self._runner.call("flush the cache", lambda: requests.post(self.url + "/flush_cache", timeout=30),
                                     self.rollout.timeout_s)
        if response.status_code != 200:
            raise RolloutError(f"{self.name}: /flush_cache: HTTP {response.status_code}: {response.text[:300]}")

    def call_engine(self, method: str, body: dict) -> Any:
        return self._post(f"/{method}", body, method)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.process is not None:
            kill_process_group(self.process, grace_s=15)  # SIGTERM exits the server and its children in ~3 s
            self.process = None
        import shutil

        shutil.rmtree(self.weights_dir, ignore_errors=True)
        self._runner.stop()


def _flags(args: dict[str, Any]) -> list[str]:
    """{"tp_size": 2, "disable_cuda_graph": True} -> ["--tp-size", "2", "--disable-cuda-graph"]."""
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


def _data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes exactly these pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
