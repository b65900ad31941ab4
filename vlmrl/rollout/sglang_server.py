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
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from vlmrl.models.families import read_model_config
from vlmrl.actor.config import PRECISIONS
from vlmrl.rollout.base import BackendOptions, DeadlineRunner, merged
from vlmrl.rollout.errors import EngineDeadError, InvalidRequestError, RolloutError
from vlmrl.rollout.sglang import SGLangCommon, engine_env
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.servers import LaunchedServer, ServerExited, ServerNotReady, flags, wait_for_health

logger = logging.getLogger(__name__)


class SGLangServerBackend(SGLangCommon):
    """HTTP client of an SGLang server: one vlmrl launches (`python -m sglang.launch_server` on rollout.server.host,
    a free port, its own log file) or one the user runs (rollout.server.url)."""

    name = "sglang-server"
    text_key = "text"  # /generate's JSON

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        self.server: LaunchedServer | None = None
        """The server vlmrl launched (None for one given by URL)."""
        self.log_path = ""
        self.weights_dir = Path(tempfile.mkdtemp(prefix="vlmrl-sglang-weights-"))
        self._runner = DeadlineRunner(self.name, self._health)
        try:
            server = self.rollout.server
            if server.url:
                self.url = server.url.rstrip("/")
                # the user says how the server runs; vlmrl cannot tell whether its weights are backed up
                self.memory_saver = bool(self.rollout.sglang.enable_memory_saver)
                self._runner.call("reach the server", lambda: self._wait_ready(30), self.rollout.start_timeout_s)
                self._check_server_settings(self._server_info())
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
        self.server = LaunchedServer("sglang.launch_server", flags(self.start_args()), host=server.host,
                                     port=server.port, log_file=server.log_file, log_prefix="vlmrl-sglang-server",
                                     env=engine_env(self.options, self.on_cuda), name="SGLang server")
        self.engine_pids = [self.server.pid]
        self.url, self.log_path = self.server.url, self.server.log_path
        logger.info("sglang-server: launching pid %d on %s (log %s)", self.server.pid, self.url, self.log_path)
        timeout = self.rollout.start_timeout_s
        self._runner.call("start the server", lambda: self._wait_ready(timeout), timeout + 5)
        return self.url

    @property
    def process(self) -> subprocess.Popen | None:
        """The launched server's process (None for a server given by URL, or once closed)."""
        return self.server.process if self.server else None

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            wait_for_health(self.url, timeout_s, self._health)
        except ServerExited as err:
            raise EngineDeadError(f"{self.name}: {err}") from None
        except ServerNotReady as err:
            raise RolloutError(f"{self.name}: {err}{self._log_hint()}") from None

    def _server_info(self) -> dict[str, Any]:
        """A server's /server_info (its server arguments), under the call deadline."""
        import requests

        info = self._runner.call("read the server's settings",
                                 lambda: requests.get(f"{self.url}/server_info", timeout=30), self.rollout.timeout_s)
        if info.status_code != 200:
            raise RolloutError(f"{self.name}: GET {self.url}/server_info: HTTP {info.status_code}: cannot check the "
                               "server's engine settings")
        return info.json()

    def _check_server_settings(self, info: dict[str, Any]) -> None:
        """A server vlmrl did not start runs in the dtype it was started with, not the one vlmrl would resolve: the
        backend takes the server's (the weight sync casts to it, artifacts and compare's thresholds follow it), and
        refuses an explicit rollout.dtype the server does not run. And it must have been started with what the
        family needs where config.json lacks it (`--json-model-override-args`): otherwise it would agree with
        nothing the trainer computes, silently. Refused unless family_engine_settings=false."""
        model_config = read_model_config(self.model_path)
        served = server_dtype(info.get("dtype") or "auto", model_config)
        if self.rollout.dtype not in ("auto", served):
            raise RolloutError(f"{self.name}: rollout.dtype={self.rollout.dtype}, but the server at {self.url} runs "
                               f"{self.model_path} in {served}: restart it with --dtype {self.rollout.dtype}, or set "
                               f"rollout.dtype={served} (or auto)")
        if served not in PRECISIONS:
            raise RolloutError(f"{self.name}: the server at {self.url} runs in {served} (its --dtype "
                               f"{info.get('dtype') or 'auto'}), which vlmrl does not train against: restart it "
                               "with --dtype bfloat16 or --dtype float32")
        self.dtype = served
        if not self.rollout.family_engine_settings or not self.processor.family.engine_overrides(model_config):
            return
        given = json.loads(info.get("json_model_override_args") or "{}")
        problems = self.processor.family.engine_problems(merged(model_config, given), self.name)
        if problems:
            needed = json.dumps(self.processor.family.engine_overrides(model_config))
            raise RolloutError(
                f"{self.name}: the server at {self.url} runs {self.model_path} without the settings that make it "
                f"compute what transformers computes: {' '.join(problems)} Restart it with "
                f"--json-model-override-args '{needed}' (or fix config.json), let vlmrl launch the server (empty "
                "rollout.server.url), or set rollout.family_engine_settings=false to accept the drift")

    def _health(self) -> str | None:
        problem = self.server.exited() if self.server else None
        return problem + self._log_hint() if problem else None

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
        if self.server is not None:
            self.server.close()  # SIGTERM exits the server and its children in ~3 s
        import shutil

        shutil.rmtree(self.weights_dir, ignore_errors=True)
        self._runner.stop()


def _data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes exactly these pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def server_dtype(flag: str, model_config: dict[str, Any]) -> str:
    """The dtype an SGLang server computes in, from its `--dtype` (/server_info) and the model's config.json, by
    sglang 0.5.23's own rule (`_get_and_verify_dtype`): `auto` takes the config's dtype, and a float32 (or unnamed)
    one becomes float16.

    >>> server_dtype("bfloat16", {"dtype": "float32"}), server_dtype("auto", {"torch_dtype": "bfloat16"})
    ('bfloat16', 'bfloat16')
    >>> server_dtype("auto", {"dtype": "float32"}), server_dtype("float", {})
    ('float16', 'float32')
    """
    names = {"float": "float32", "half": "float16"}  # sglang's other spellings
    flag = names.get(flag.lower(), flag.lower())
    if flag != "auto":
        return flag
    config = model_config.get("dtype") or model_config.get("torch_dtype") or "float32"
    config = names.get(str(config).lower(), str(config).lower())
    return "float16" if config == "float32" else config
