"""The SGLang backends: `sglang` (the in-process `Engine`) and `sglang-server` (HTTP to a server vlmrl launches on
127.0.0.1, or to a URL the user gives). The only module of vlmrl that imports sglang, and only inside a backend.

Both send the same request: `input_ids` with ONE `<|image_pad|>` per image (SGLang hangs on pre-expanded ids) and
the resized images (PIL for the Engine, base64 PNG data URLs over HTTP).

Videos (Engine only): SGLang 0.5.23 takes no timing with frames given as an array: its processor reads every such
video as 24 fps (second_per_grid_ts = 2/24), whatever the video's rate. So a request with a video goes as SGLang's
`processor_output` form instead: the model's own processor outputs for the request's frames and images, computed
by vlmrl (`pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts` = 2 / sampled fps, and the images'
`pixel_values`, `image_grid_thw`) in one `video_data` entry, with the EXPANDED prompt ids (that form takes them
expanded; for Qwen3-VL they carry the `<x.x seconds>` text of each temporal patch, and no second_per_grid_ts goes).
Measured: its logprobs then equal transformers' at the video's own fps. SGLang keys its prefix cache on
the pixel values' hash, so a one-video entry carries vlmrl's hash of the frames and their timing instead; an entry
holding an image and a video cannot carry one (SGLang takes a hash for one-item entries only): the same pixels sent
again at another fps would reuse the first one's prompt KV. For Qwen2.5-VL the entry also splits the video's grid
into one row per temporal patch and carries vlmrl's mrope positions (`ModelFamily.sglang_video_per_step_grids`):
SGLang's own tower attends across a video's temporal patches, transformers' and vLLM's within each.

`sglang-server` refuses video requests: no request over HTTP reaches what transformers computes.
- The /generate JSON takes a video only as a string (path, URL, base64 / data URL of a file) or a MediaRef (`url`
  plus sampling hints: fps, num_frames, min/max_pixels...); a `processor_output` dict is rejected (HTTP 400 "unknown
  field `format`", measured), and tensors have no JSON form there.
- From a file, sglang 0.5.23's Qwen2.5-VL processor samples and resizes by the server-wide `mm_process_config`
  only (the MediaRef hints are not read for this model; the default resize puts every frame at >= 128*28*28
  pixels), and gives transformers' video processor no metadata, so second_per_grid_ts is 2/24 (24 fps) whatever the
  file's rate.
- Its tower's attention across temporal patches (above) can be corrected only through `processor_output`.
So a lossless file at the sampling rate (which a decoder in the server, decord or torchcodec, would read back
frame for frame) would still get other temporal positions and other video features for any video over 2 frames.

Logprobs: the engine runs with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (before temperature; checked at start by a probe
that compares a hot-temperature logprob with the greedy one). SGLang applies `logit_bias` BEFORE it computes
logprobs, so the pad-token ban (a bias of `BAN_LOGIT_BIAS`) would renormalise them over the allowed tokens; the
banned tokens' own logprobs are requested too (`token_ids_logprob`) and the raw value is restored exactly:
    raw = returned - log1p(sum_b exp(returned_b - BAN_LOGIT_BIAS))
so every backend returns log_softmax of the raw logits over the whole vocabulary.
Banned tokens: `logit_bias` of -1e4: their probability underflows to exactly 0 for any temperature below ~90.
Samples: each of the n samples is its own entry of one batched call, with `sampling_seed = seed + position * n + i`
(SGLang honours it only with `enable_deterministic_inference`, which torch_native attention on CPU refuses).
Stale vision embeddings: SGLang's multimodal embedding cache survives weight updates and `flush_cache`. The engines
vlmrl starts run with `SGLANG_VLM_CACHE_SIZE_MB=vlm_cache_size_mb` (0 by default), and every request also carries
`mm_hashes` salted with the weight version, so a cache (e.g. a server given by URL) never serves old embeddings.
Where SGLang cannot take caller mm_hashes (Qwen3-VL: `ModelFamily.sglang_caller_mm_hashes`) none are sent and the
cache must stay off (a non-zero vlm_cache_size_mb is refused).
Engine settings: where the model's config.json lacks what its family needs for the engine to compute what
transformers computes (Qwen3-VL's `mrope_interleaved`), the engine starts with them as `json_model_override_args`; a
server given by URL must have been started with them (checked at connect, from /server_info).
Weight sync: Engine `update_weights_from_tensor` between `begin_weight_update` / `end_weight_update`; server:
safetensors written to a private folder, then `/update_weights_from_disk` (no pickled payloads over HTTP).

Process care: `Engine.shutdown()` kills EVERY child of the calling process (other engines included) and its
watchdog sends SIGQUIT to the caller when a child dies; this backend stops that watchdog, replaces the atexit
shutdown with its own, and on close kills only the processes its engine started. Creating an Engine sets the
multiprocessing start method to 'spawn' for the whole process (SGLang does this).
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import io
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.models.families import read_model_config
from vlmrl.rollout.base import (
    DeadlineRunner,
    EngineDeadError,
    InvalidRequestError,
    RolloutBackend,
    RolloutError,
    RolloutOptions,
    assert_nothing_banned,
    family_engine_overrides,
    merged,
    sample_seed,
    top_allowed,
)
from vlmrl.rollout.config import ServerOptions, ServingEngineOptions
from vlmrl.rollout.logs import route_engine_logs
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.processes import env_override, is_alive, kill_process_group, kill_tree

logger = logging.getLogger(__name__)

BAN_LOGIT_BIAS = -1e4


@dataclass
class SGLangOptions(ServingEngineOptions, RolloutOptions):
    """Options of the `sglang` backend (names as in verl/EasyR1; SGLang's own in engine_kwargs)."""

    max_total_tokens: int | None = None
    """KV cache size in tokens; None = SGLang's choice on GPU, 8192 on CPU (else it allocates ~6 GB)."""
    attention_backend: str | None = None
    """None = torch_native on CPU (the one that runs there), SGLang's default on GPU."""
    vlm_cache_size_mb: int = 0
    """SGLang's multimodal embedding cache (SGLANG_VLM_CACHE_SIZE_MB). 0 = off: nothing computed with old vision
    weights can be served. Salted mm_hashes make a non-zero cache safe too; it saves re-encoding repeated images.
    Refused on Qwen3-VL, where SGLang cannot take salted mm_hashes."""
    enable_memory_saver: bool = False
    """Let sleep()/wake_up() release and resume GPU memory (CUDA only)."""
    log_level: str = "error"
    """SGLang's log level."""


@dataclass
class SGLangServerOptions(ServerOptions, SGLangOptions):
    """Options of the `sglang-server` backend."""

    port: int = 0
    """Port of the launched server; 0 = a free one."""
    log_file: str = ""
    """Where the launched server's output goes; empty = a file in the temp folder (named in errors)."""


# ---------------------------------------------------------------------------------------------------- shared logic


class _SGLangCommon(RolloutBackend):
    """Request building, result parsing and the start-up checks both SGLang backends share."""

    options: SGLangOptions

    def __init__(self, model_path: str, options: SGLangOptions):
        super().__init__(model_path, options)
        self.on_cuda = torch.cuda.is_available()
        self.weight_version = 0
        self._sleeping = False
        family = self.processor.family
        self.salt_mm_hashes = family.sglang_caller_mm_hashes
        """Send mm_hashes salted with the weight version; where SGLang cannot take them (the family says), the
        engine must run with no multimodal cache instead: flush_cache after a sync then drops everything old."""
        if not self.salt_mm_hashes and options.vlm_cache_size_mb:
            raise ValueError(
                f"{self.name}: vlm_cache_size_mb={options.vlm_cache_size_mb} on {family.name}: after a weight sync "
                "the multimodal cache would serve features of the old vision weights, and the salted mm_hashes that "
                f"prevent it crash SGLang's scheduler on {family.name} images; set vlm_cache_size_mb=0")

    def engine_env(self) -> dict[str, str]:
        """Environment the engine processes must start with."""
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_VLM_CACHE_SIZE_MB": str(self.options.vlm_cache_size_mb)}
        if not self.on_cuda:
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # the only switch that makes device="cpu" take CPU code paths
        return env

    def engine_args(self) -> dict[str, Any]:
        """SGLang server arguments (Engine keywords; `--flag value` for the server)."""
        o = self.options
        args: dict[str, Any] = dict(model_path=self.model_path, dtype=o.resolved_dtype(),
                                    context_length=o.max_model_len, random_seed=o.seed, tp_size=o.tensor_parallel_size,
                                    mem_fraction_static=o.gpu_memory_utilization, log_level=o.log_level)
        if not self.on_cuda:
            args.update(device="cpu", disable_cuda_graph=True, max_total_tokens=o.max_total_tokens or 8192,
                        attention_backend=o.attention_backend or "torch_native")
        else:
            if o.max_total_tokens:
                args["max_total_tokens"] = o.max_total_tokens
            if o.attention_backend:
                args["attention_backend"] = o.attention_backend
            if o.enable_memory_saver:
                args["enable_memory_saver"] = True
        overrides = family_engine_overrides(self.model_path, self.processor.family, o.family_engine_settings,
                                            self.name)
        extra = dict(o.engine_kwargs)
        if overrides or "json_model_override_args" in extra:  # the user's own overrides merge over the family's
            user = extra.pop("json_model_override_args", "{}")
            args["json_model_override_args"] = json.dumps(merged(overrides, json.loads(user) if isinstance(user, str)
                                                                 else user))
        args.update(extra)
        return args

    def encode_images(self, images: Sequence[Any]) -> list[Any]:
        """How images travel to this engine (PIL for the Engine; data URLs over HTTP)."""
        return list(images)

    def video_entry(self, request: RolloutRequest) -> tuple[list[int], list[Any], list[Any]]:
        """(input_ids, image_data, video_data) of a request with videos: expanded ids and ONE `processor_output`
        entry holding the request's image and video inputs with their timing (see the module docstring)."""
        mm = self.processor.multi_modal_inputs(request)
        ids = self.processor.expand_prompt_ids(request.prompt_ids, mm.get("image_grid_thw"), mm.get("video_grid_thw"),
                                               request.videos)
        entry: dict[str, Any] = {"format": "processor_output", **mm}
        if self.processor.family.sglang_video_per_step_grids:
            entry.update(per_step_video_grids(self.processor, ids, mm))
        if len(request.videos) == 1 and not request.images:
            # SGLang keys its prefix cache on a hash of the pixel values alone, so the same frames at another fps
            # (other position ids) would reuse KV computed at the first one's (measured). The video's hash covers
            # its timing; salted with the weight version. SGLang takes a hash only for a one-item entry.
            digest = hashlib.sha256(f"{request.videos[0].hash}:{self.weight_version}".encode()).hexdigest()
            entry["hash"] = int(digest[:15], 16)
        return ids, [], [entry]

    def payload(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> dict[str, Any]:
        """One batched /generate input, one entry per sample, request-major (verl sends n copies the same way).
        SGLang's own `n` would give all samples of a request one seed, and it prefills the prompts one after
        another before sampling (SGLang warns about it above 128 prompts); at 8 prompts x n=8 on tiny-large both
        took the same time (9.0-10.0 s vs 9.2-9.8 s)."""
        from vlmrl.processors import image_hash

        draws = 1 if sampling.greedy else sampling.n
        entries: dict[str, list] = {"input_ids": [], "image_data": [], "sampling_params": [], "mm_hashes": []}
        with_video = any(r.videos for r in requests)
        if with_video:
            entries["video_data"] = []
        for position, request in enumerate(requests):
            salted = None
            if self.salt_mm_hashes:
                hashes = request.image_hashes or [image_hash(im) for im in request.images]
                # The weight version in the hash keeps any multimodal cache from serving old-weight embeddings.
                salted = [hashlib.sha256(f"{h}:{self.weight_version}".encode()).hexdigest()[:16] for h in hashes]
            ids, images, videos = list(request.prompt_ids), self.encode_images(request.images), None
            if request.videos:
                ids, images, videos = self.video_entry(request)
            seed = sample_seed(sampling, position)
            for i in range(draws):
                params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                          "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
                          "logit_bias": {str(t): BAN_LOGIT_BIAS for t in request.banned_token_ids} or None}
                if seed is not None:
                    params["sampling_seed"] = seed + i
                entries["input_ids"].append(ids)
                entries["image_data"].append(images)
                entries["sampling_params"].append(params)
                entries["mm_hashes"].append(salted)
                if with_video:
                    entries["video_data"].append(videos)
        if with_video:
            # SGLang takes mm_hashes for images only (one per image): with videos it hashes every item itself (the
            # multimodal cache is off by default, and a weight update flushes the prefix cache).
            del entries["mm_hashes"]
        body: dict[str, Any] = {**entries, "return_logprob": True}
        if not self.salt_mm_hashes:
            body.pop("mm_hashes", None)
        banned = sorted({t for r in requests for t in r.banned_token_ids})
        if banned:  # one flat list for the whole batch: the union (only a request's own ids are biased)
            body["token_ids_logprob"] = banned
        if sampling.top_logprobs:
            body["top_logprobs_num"] = sampling.top_logprobs + len(banned)
        return body

    def parse(self, outputs: list[dict], requests: Sequence[RolloutRequest], sampling: SamplingParams
              ) -> list[RolloutResult]:
        draws = 1 if sampling.greedy else sampling.n
        if len(outputs) != len(requests) * draws:
            raise RolloutError(f"{self.name}: {len(outputs)} outputs for {len(requests)} requests x {draws}")
        results = []
        for position, request in enumerate(requests):
            own = outputs[position * draws:(position + 1) * draws]
            for i in range(sampling.n):
                results.append(_result(own[i % draws], request, i, sampling.top_logprobs))
        return results

    def check_raw_logprobs(self, generate) -> None:
        """Fail start-up unless logprobs come from the raw distribution: the token forced at temperature 5 (top_p
        keeps only the argmax) must carry the greedy logprob. `generate(payload) -> outputs`."""
        ids = self.processor.tokenizer.encode("Hello", add_special_tokens=False)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
        hot = SamplingParams(temperature=5.0, top_p=1e-6, max_new_tokens=1)
        probe = RolloutRequest(uid="raw-logprob-probe", prompt_ids=ids,
                               banned_token_ids=self.processor.banned_token_ids)
        (g,), (h,) = (self.parse(generate(self.payload([probe], s)), [probe], s) for s in (greedy, hot))
        if g.response_ids == h.response_ids and abs(g.response_logprobs[0] - h.response_logprobs[0]) > 1e-3:
            raise RolloutError(
                f"{self.name}: the engine returns logprobs after temperature ({h.response_logprobs[0]:.4f} at T=5 "
                f"vs {g.response_logprobs[0]:.4f} raw); start it with SGLANG_RETURN_ORIGINAL_LOGPROB=1")

    def sleep(self) -> None:
        if not self.options.enable_memory_saver:
            return super().sleep()
        self.call_engine("release_memory_occupation", {})
        self._sleeping = True

    def wake_up(self) -> None:
        if not self._sleeping:
            return super().wake_up()
        self.call_engine("resume_memory_occupation", {})
        self._sleeping = False

    def call_engine(self, method: str, body: dict) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


def per_step_video_grids(processor: Any, ids: Sequence[int], mm: dict[str, Any]) -> dict[str, Any]:
    """The `processor_output` keys that make sglang 0.5.23's Qwen2.5-VL tower attend within each temporal patch of
    a video, as transformers does (`ModelFamily.sglang_video_per_step_grids`): `video_grid_thw` with one (1, h, w)
    row per temporal patch (the patches are already in that order in `pixel_values_videos`), and the prompt's mrope
    positions from vlmrl (`mrope_positions` (3, L), `mrope_position_delta`), since SGLang's own would read the rows
    as t videos."""
    from vlmrl.processors.rope import split_video_frames

    grid = mm["video_grid_thw"]
    split = split_video_frames(grid)
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    positions = processor.position_ids(input_ids, None, mm.get("image_grid_thw"), grid,
                                       mm.get("second_per_grid_ts"))[:, 0]  # (3, L)
    delta = torch.tensor([[int(positions.max()) + 1 - len(ids)]], dtype=torch.long)
    return {"video_grid_thw": split, "mrope_positions": positions, "mrope_position_delta": delta}


def _result(out: dict, request: RolloutRequest, sample_index: int, top_k: int) -> RolloutResult:
    """One SGLang output -> RolloutResult, with the pad-ban renormalisation undone (see the module docstring)."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    banned = set(request.banned_token_ids)
    banned_lps = meta.get("output_token_ids_logprobs") if banned else None
    shifts = []
    for pos in range(len(ids)):
        # Only this request's banned ids carry the bias; the batch may ask for more ids.
        mass = sum(math.exp(e[0] - BAN_LOGIT_BIAS) for e in banned_lps[pos] if e[1] in banned) if banned_lps else 0.0
        shifts.append(math.log1p(mass))
    logprobs = [entry[0] - shift for entry, shift in zip(meta["output_token_logprobs"], shifts)]
    tops = None
    if top_k:
        tops = [top_allowed({e[1]: e[0] - shift for e in position}, top_k, request.banned_token_ids)
                for position, shift in zip(meta["output_top_logprobs"], shifts)]
    reason = (meta.get("finish_reason") or {}).get("type")
    return RolloutResult(uid=request.uid, sample_index=sample_index, response_ids=ids, response_logprobs=logprobs,
                         finish_reason=reason if reason in ("stop", "length") else "abort", top_logprobs=tops)


def _quit_signal_survivor(signum, frame) -> None:
    """SGLang children send SIGQUIT to their parent when they fail; its own handler would kill the whole process
    tree, the trainer included. Log instead: the backend's health check fails its next call."""
    logger.error("an SGLang child process reported a failure (SIGQUIT); the sglang backend will fail its next call")


# ---------------------------------------------------------------------------------------------------- Engine


class SGLangBackend(_SGLangCommon):
    """SGLang's in-process `Engine` (scheduler and detokenizer in child processes)."""

    name = "sglang"
    options_class = SGLangOptions
    accepts_partial_weights = True  # update_weights_from_tensor loads the tensors it is given, by name

    def __init__(self, model_path: str, options: SGLangOptions):
        super().__init__(model_path, options)
        self.engine = None
        self._runner = DeadlineRunner(self.name, self._health)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, _quit_signal_survivor)
        try:
            self.engine = self._runner.call("start the engine", self._start, options.start_timeout_s)
            atexit.register(self.close)
            self.check_raw_logprobs(lambda body: self._runner.call("probe", lambda: self.engine.generate(**body),
                                                                   options.timeout_s))
        except BaseException:
            self.close()  # a failed start must not leave the engine's processes behind
            raise

    def _start(self):
        env = self.engine_env()
        # Inherited by the scheduler processes spawned below; SGLANG_USE_CPU_ENGINE stays set (this process's
        # sglang reads it too), the two engine settings are put back afterwards.
        if "SGLANG_USE_CPU_ENGINE" in env:
            os.environ["SGLANG_USE_CPU_ENGINE"] = env.pop("SGLANG_USE_CPU_ENGINE")
        with env_override(env):
            route_engine_logs("sglang", self.options.log_level)
            import sglang

            # Built on this engine thread: no signal handlers are installed and the engine's event loop is this
            # thread's, which every later call runs on.
            engine = sglang.Engine(**self.engine_args())
        atexit.unregister(engine.shutdown)  # it would kill every child of this process at exit
        watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it SIGQUITs this process when a child dies; our health check reports it instead
        self.engine_pids = list(engine.get_all_child_pids())
        logger.info("sglang: engine up on %s (%s), processes %s", self.model_path, self.options.resolved_dtype(),
                    self.engine_pids)
        return engine

    def _health(self) -> str | None:
        for pid in self.engine_pids:
            if not is_alive(pid):
                return f"an SGLang engine process (pid {pid}: scheduler or detokenizer) has exited"
        return None

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        self.check_requests(requests, sampling)
        body = self.payload(requests, sampling)
        outputs = self._runner.call(f"generate {len(requests)} requests", lambda: self.engine.generate(**body),
                                    self.options.timeout_s)
        results = self.parse(outputs, requests, sampling)
        assert_nothing_banned(results, requests, sampling.n, self.name)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
                       ) -> None:
        sync = self.sync_plan(named_tensors, names)
        timeout = self.options.timeout_s
        # outside begin/end an update returns (False, ...) and changes nothing
        self._runner.call("begin the weight update", self.engine.begin_weight_update, timeout)
        try:
            for bucket in sync.buckets:
                ok, message = self._runner.call(
                    f"load {len(bucket)} tensors",
                    lambda bucket=bucket: self.engine.update_weights_from_tensor(list(bucket.items()),
                                                                                 flush_cache=False), timeout)[:2]
                if not ok:
                    raise RolloutError(f"{self.name}: update_weights_from_tensor refused: {message}")
                del bucket  # host memory holds one bucket while the next is read
        finally:
            self._runner.call("end the weight update", self.engine.end_weight_update, timeout)
        flushed = self._runner.call("flush the cache", self.engine.flush_cache, timeout)  # once, not per bucket
        if not flushed.success:
            raise RolloutError(f"{self.name}: flush_cache refused after the weight update: {flushed.message}")
        self.weight_version += 1
        logger.debug("sglang: loaded %d tensors (weight version %d); caches flushed", len(sync.names),
                     self.weight_version)

    def call_engine(self, method: str, body: dict) -> Any:
        return self._runner.call(method, lambda: getattr(self.engine, method)(**body), self.options.timeout_s)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.engine is not None:
            manager = self.engine.tokenizer_manager
            for pid in self.engine_pids:
                kill_tree(pid)
            mm_processor = getattr(manager, "mm_processor", None)
            if mm_processor is not None:
                mm_processor.shutdown()
            self.engine = None
        self._runner.stop()


# ---------------------------------------------------------------------------------------------------- HTTP server


class SGLangServerBackend(_SGLangCommon):
    """HTTP client of an SGLang server: one vlmrl launches (`python -m sglang.launch_server` on 127.0.0.1, a free
    port, its own log file) or one the user runs (`server_url`)."""

    name = "sglang-server"
    options_class = SGLangServerOptions

    def __init__(self, model_path: str, options: SGLangServerOptions):
        super().__init__(model_path, options)
        self.process: subprocess.Popen | None = None
        self.log_path = ""
        self.weights_dir = Path(tempfile.mkdtemp(prefix="vlmrl-sglang-weights-"))
        self._runner = DeadlineRunner(self.name, self._health)
        try:
            if options.server_url:
                self.url = options.server_url.rstrip("/")
                self._runner.call("reach the server", lambda: self._wait_ready(deadline=time.monotonic() + 30),
                                  options.start_timeout_s)
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
        o: SGLangServerOptions = self.options  # type: ignore[assignment]
        port = o.port or _free_port()
        args = {**self.engine_args(), "host": "127.0.0.1", "port": port}
        command = [sys.executable, "-m", "sglang.launch_server", *_flags(args)]
        self.log_path = o.log_file or os.path.join(tempfile.gettempdir(), f"vlmrl-sglang-server-{port}.log")
        with open(self.log_path, "ab") as log:
            # Own session: close() can end the server's whole process group without touching ours.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.engine_env()}, start_new_session=True)
        self.engine_pids = [self.process.pid]
        url = f"http://127.0.0.1:{port}"
        logger.info("sglang-server: launching pid %d on %s (log %s)", self.process.pid, url, self.log_path)
        self.url = url
        self._runner.call("start the server", lambda: self._wait_ready(time.monotonic() + o.start_timeout_s),
                          o.start_timeout_s + 5)
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
        if not self.options.family_engine_settings or not self.processor.family.engine_overrides(model_config):
            return
        info = self._runner.call("read the server's settings",
                                 lambda: requests.get(f"{self.url}/server_info", timeout=30), self.options.timeout_s)
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
                "server_url), or set family_engine_settings=false to accept the drift")

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
                response = requests.post(self.url + route, json=body, timeout=self.options.timeout_s)
            except requests.ConnectionError as err:
                raise EngineDeadError(f"{self.name}: {what}: the server at {self.url} does not answer "
                                      f"({type(err).__name__}){self._log_hint()}") from err
            if response.status_code != 200:
                raise RolloutError(f"{self.name}: {what}: HTTP {response.status_code} from {route}: "
                                   f"{response.text[:500]}")
            return response.json()

        return self._runner.call(what, run, self.options.timeout_s)

    def encode_images(self, images: Sequence[Any]) -> list[Any]:
        return [_data_url(im) for im in images]

    def video_entry(self, request: RolloutRequest) -> tuple[list[int], list[Any], list[Any]]:
        raise InvalidRequestError(f"{self.name}: request {request.uid} holds {len(request.videos)} video(s): over "
                                  "HTTP SGLang takes a video only as a file (no processor outputs), and from a file "
                                  "its Qwen2.5-VL path reads every video as 24 fps, resizes by server-wide settings "
                                  "and attends across temporal patches, unlike transformers (see vlmrl.rollout."
                                  "sglang); use the sglang (Engine), vllm or hf backend")

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        self.check_requests(requests, sampling)
        outputs = self._post("/generate", self.payload(requests, sampling), f"generate {len(requests)} requests")
        results = self.parse(outputs, requests, sampling)
        assert_nothing_banned(results, requests, sampling.n, self.name)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
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
                                     self.options.timeout_s)
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes exactly these pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
