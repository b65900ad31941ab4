"""The SGLang in-process `Engine` backend (`sglang`) and what it shares with `sglang-server`
(`vlmrl.rollout.sglang_server`): the only module of vlmrl that imports sglang, and only inside a backend.

Both send `input_ids` with ONE `<|image_pad|>` per image and the already-resized images. A request with a video goes
as SGLang's `processor_output` form (the model's own processor outputs, computed by vlmrl, with the video's real
timing and, for Qwen2.5-VL, one grid row per temporal patch plus vlmrl's mrope positions), since SGLang reads
frames given as an array at 24 fps and its tower attends across temporal patches. Raw logprobs come from
`SGLANG_RETURN_ORIGINAL_LOGPROB=1` (checked at start by a probe); the pad-token ban is a logit bias, whose
renormalisation of the logprobs is undone exactly (`_result`). mm_hashes salted with the weight version keep the
multimodal cache from serving old-weight embeddings. The memory saver (rollout.sglang.enable_memory_saver) releases
GPU memory while the actor trains. `Engine.shutdown()` would kill every child of this process, so this backend ends
only the processes its engine started. docs/engines.md ("SGLang") has the measurements behind each of these.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from vlmrl.models.experts import RoutingLayout
from vlmrl.models.families import ModelFamily, read_model_config
from vlmrl.rollout.base import (
    BackendOptions,
    DeadlineRunner,
    RolloutBackend,
    captures_routing,
    family_engine_overrides,
    merged,
    release_memory,
)
from vlmrl.rollout.config import SGLangConfig, even_binding
from vlmrl.rollout.errors import EngineSettingError, InvalidRequestError, RolloutError, ServerSettingError
from vlmrl.rollout.logs import route_engine_logs
from vlmrl.rollout.requests import describe, sample_seed, top_allowed
from vlmrl.rollout.scoring import ScoredResponse, response_tail, response_top_tail
from vlmrl.rollout.sglang_weight_group import SGLangWeightGroup
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.processes import env_override, is_alive, kill_tree

logger = logging.getLogger(__name__)

BAN_LOGIT_BIAS = -1e4


def engine_env(options: BackendOptions, on_cuda: bool) -> dict[str, str]:
    """Environment the rollout engine's processes must start with: raw logprobs (the rollout contract), what
    `server_env` sets and, on a CPU at tensor parallel k > 1, each TP rank's cores (SGLang refuses more TP ranks than
    NUMA nodes without SGLANG_CPU_OMP_THREADS_BIND; an explicit value in the environment wins)."""
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **server_env(options.rollout.sglang, on_cuda)}
    k = options.rollout.tensor_parallel_size
    if not on_cuda and k > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = options.cpu_binding or even_binding(k, os.cpu_count() or 1)
    return env


def server_env(section: SGLangConfig, on_cuda: bool) -> dict[str, str]:
    """Environment of any SGLang vlmrl starts (the judge's server too): its multimodal cache size and, on a CPU, its
    CPU switch (`cpu_env`)."""
    return {"SGLANG_VLM_CACHE_SIZE_MB": str(section.vlm_cache_size_mb), **({} if on_cuda else cpu_env())}


def cpu_env() -> dict[str, str]:
    """What SGLang needs on a CPU: SGLANG_USE_CPU_ENGINE=1, the only switch that makes device="cpu" take its CPU
    code paths (read at `import sglang`). Left out when the environment already sets it: an explicit value wins."""
    return {} if "SGLANG_USE_CPU_ENGINE" in os.environ else {"SGLANG_USE_CPU_ENGINE": "1"}


def engine_args(model_path: str, options: BackendOptions, family: ModelFamily | None, on_cuda: bool, backend: str
                ) -> dict[str, Any]:
    """SGLang server arguments (Engine keywords; `--flag value` for the server) for a backend's options: the rollout
    section's neutral knobs, rollout.sglang and what the run derives. `family` None: a model of no family vlmrl
    knows (a judge's), started as its config.json says. Pure: what a run config sets can be checked without
    starting the engine."""
    r, o = options.rollout, options.rollout.sglang
    dtype = options.resolved_dtype(family)
    if not on_cuda and family is not None:
        problems = family.cpu_engine_problems(read_model_config(model_path), backend, dtype)
        if problems:
            raise EngineSettingError(f"{backend}: " + " ".join(problems))
    args: dict[str, Any] = dict(model_path=model_path, dtype=dtype,
                                context_length=options.max_model_len, random_seed=options.seed,
                                tp_size=r.tensor_parallel_size, mem_fraction_static=r.gpu_memory_utilization,
                                log_level=o.log_level,
                                enable_memory_saver=release_memory(o.enable_memory_saver, on_cuda, options.colocated))
    if captures_routing(r, backend, family):
        if not on_cuda:
            raise EngineSettingError(f"{backend}: rollout.sglang.capture_routing needs a GPU (SGLang's "
                                     "routed-experts buffer is CUDA-host-registered; its scheduler dies on a CPU): on "
                                     "a CPU use rollout.name=vllm with rollout.vllm.capture_routing=true")
        args["enable_return_routed_experts"] = True
    if not on_cuda:
        # sleep_on_idle: an idle scheduler blocks on its sockets (waking at once on a request) instead of polling,
        # which holds a whole core on a CPU machine (measured on 2 cores: 1.01 cores idle, 0.02 with it) that the
        # trainer beside it needs
        args.update(device="cpu", disable_cuda_graph=True, max_total_tokens=o.max_total_tokens or 8192,
                    attention_backend=o.attention_backend or "torch_native", sleep_on_idle=True,
                    **dict(family.engines.sglang_cpu_args if family else ()))
    else:
        if o.max_total_tokens:
            args["max_total_tokens"] = o.max_total_tokens
        if o.attention_backend:
            args["attention_backend"] = o.attention_backend
    overrides = family_engine_overrides(model_path, family, r.family_engine_settings, backend) if family else {}
    extra = dict(o.engine_kwargs)
    if overrides or "json_model_override_args" in extra:  # the user's own overrides merge over the family's
        user = extra.pop("json_model_override_args", "{}")
        args["json_model_override_args"] = json.dumps(merged(overrides, json.loads(user) if isinstance(user, str)
                                                             else user))
    args.update(extra)
    return args


def with_own_nccl_port(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with an nccl_port drawn by vlmrl (`free_port_below_ephemeral`: the OS's randomness, not the global
    `random` a vLLM engine in this process seeds) unless the user's engine_kwargs set one."""
    from vlmrl.utils.servers import free_port_below_ephemeral

    return args if args.get("nccl_port") else {**args, "nccl_port": free_port_below_ephemeral()}


# ---------------------------------------------------------------------------------------------------- shared logic


class SGLangCommon(RolloutBackend):
    """Request building, result parsing and the start-up checks both SGLang backends share."""

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        self.on_cuda = torch.cuda.is_available()
        self.weight_version = 0
        self.memory_saver = False
        """The engine runs with SGLang's memory saver (sleep releases its GPU memory)."""
        self.weights_backed_up = False
        """The memory saver keeps a host copy of the weights (enable_weights_cpu_backup): they survive a sleep."""
        family = self.processor.family
        self.salt_mm_hashes = family.engines.sglang_caller_mm_hashes
        """Send mm_hashes salted with the weight version; where SGLang cannot take them (the family says), the
        engine must run with no multimodal cache instead: flush_cache after a sync then drops everything old."""
        if not self.salt_mm_hashes and self.rollout.sglang.vlm_cache_size_mb:
            raise EngineSettingError(
                f"{self.name}: rollout.sglang.vlm_cache_size_mb={self.rollout.sglang.vlm_cache_size_mb} on "
                f"{family.name}: after a weight sync "
                "the multimodal cache would serve features of the old vision weights, and the salted mm_hashes that "
                f"prevent it crash SGLang's scheduler on {family.name} images; set vlm_cache_size_mb=0")

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
        if self.processor.family.engines.sglang_video_per_step_grids:
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
        from vlmrl.processors.images import image_hash

        draws = 1 if sampling.greedy else sampling.n
        key = "input_ids" if self.processor.family.engines.sglang_prompt_ids else self.text_key
        entries: dict[str, list] = {key: [], "image_data": [], "sampling_params": [], "mm_hashes": []}
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
            if key != "input_ids":
                ids = self.prompt_text(request, position)
            elif request.videos:
                ids, images, videos = self.video_entry(request)
            seed = sample_seed(sampling, position)
            for i in range(draws):
                params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                          "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
                          "logit_bias": {str(t): BAN_LOGIT_BIAS for t in request.banned_token_ids} or None}
                if seed is not None:
                    params["sampling_seed"] = seed + i
                entries[key].append(ids)
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
        if self.captures_routing():
            body["return_routed_experts"] = True
        if not self.salt_mm_hashes:
            body.pop("mm_hashes", None)
        banned = sorted({t for r in requests for t in r.banned_token_ids})
        if banned:  # one flat list for the whole batch: the union (only a request's own ids are biased)
            body["token_ids_logprob"] = banned
        if sampling.top_logprobs:
            body["top_logprobs_num"] = sampling.top_logprobs + len(banned)
        return body

    text_key = "prompt"
    """The key of a text prompt in a generate call (the Engine's `prompt`; the server's JSON says `text`)."""

    def prompt_text(self, request: RolloutRequest, position: int) -> str:
        """The request's prompt ids as the text a text-form family's SGLang takes (special tokens kept). Raises
        InvalidRequestError unless the text tokenizes back to exactly those ids: the engine would then see another
        prompt than the trainer scores."""
        tokenizer = self.processor.tokenizer
        text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        if list(tokenizer.encode(text, add_special_tokens=False)) != list(request.prompt_ids):
            raise InvalidRequestError(
                f"{self.name}: {describe(request, position)}: SGLang takes {self.processor.family.name} prompts as "
                "text, and these prompt ids do not tokenize back from their text (the engine would see another "
                "prompt than the trainer scores); build requests with vlmrl.processors")
        return text

    def check_text_prompts(self, generate) -> None:
        """Fail start-up unless the engine expands a text-form family's prompt into exactly the ids the trainer
        scores: a probe request with a square image (one tile), its prompt's ids read back from the engine (input
        logprobs from position 0); text only where max_model_len has no room for the image (each prompt's
        expanded length is checked anyway, `parse`). `generate(payload) -> outputs`."""
        from PIL import Image

        pixels = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
        row = {"prompt": [{"role": "user", "content": "<image>Describe it."}], "images": [Image.fromarray(pixels)]}
        probe = self.processor.build_request(row, index=-1)
        expected = self.processor.prompt_inputs(probe).input_ids.tolist()
        if len(expected) >= self.options.max_model_len:
            probe = self.processor.build_request({"prompt": "Describe it."}, index=-1)
            expected = self.processor.prompt_inputs(probe).input_ids.tolist()
        sampling = SamplingParams(temperature=0.0, max_new_tokens=1)
        body = dict(self.payload([probe], sampling), logprob_start_len=0)
        (out,) = generate(body)
        engine_ids = [entry[1] for entry in out["meta_info"]["input_token_logprobs"]]
        if engine_ids != expected:
            first = next((i for i, (a, b) in enumerate(zip(engine_ids, expected)) if a != b),
                         min(len(engine_ids), len(expected)))
            raise RolloutError(f"{self.name}: the engine expands {self.processor.family.name}'s text prompt into "
                               f"{len(engine_ids)} ids, the trainer scores {len(expected)}; first difference at "
                               f"position {first}: the two would not compute the same sequence")

    def parse(self, outputs: list[dict], requests: Sequence[RolloutRequest], sampling: SamplingParams
              ) -> list[RolloutResult]:
        draws = 1 if sampling.greedy else sampling.n
        if len(outputs) != len(requests) * draws:
            raise RolloutError(f"{self.name}: {len(outputs)} outputs for {len(requests)} requests x {draws}")
        results = []
        text_form = not self.processor.family.engines.sglang_prompt_ids
        for position, request in enumerate(requests):
            own = outputs[position * draws:(position + 1) * draws]
            if text_form:  # the engine expanded a text prompt: its length must be the trainer's expansion
                expected = len(request.prompt_ids) - len(request.images) + sum(
                    self.processor.image_token_count(im) for im in request.images)
                got = own[0]["meta_info"].get("prompt_tokens")
                if got != expected:
                    raise RolloutError(f"{self.name}: {describe(request, position)}: the engine's prompt is {got} "
                                       f"tokens, the trainer's {expected}: it expanded the text otherwise")
            for i in range(sampling.n):
                results.append(_result(own[i % draws], request, i, sampling.top_logprobs,
                                       self.routing_layout() if self.captures_routing() else None))
        return results

    def _score(self, requests: Sequence[RolloutRequest], responses: list[list[int]], top_k: int
               ) -> list[ScoredResponse]:
        """prompt + response as the input of a one-token generation with input logprobs from `logprob_start_len`
        (raw: SGLANG_RETURN_ORIGINAL_LOGPROB=1, no ban bias asked), and with top_k its `input_top_logprobs`
        (`top_logprobs_num`), laid out as the token logprobs. The entry AT that start carries no logprob
        (measured: None), so it is the position before the response's first token; it counts the engine's
        expanded tokens, so the unexpanded prompt length - 1 starts at or before it (on image tokens, whose
        entries read id 0), and the response's logprobs are the last len(response) entries."""
        if not self.processor.family.engines.sglang_prompt_ids:
            raise InvalidRequestError(f"{self.name}: SGLang takes {self.processor.family.name} prompts as text, "
                                      "which cannot carry given response ids token for token; score on vllm or hf")
        unbanned = [dataclasses.replace(r, banned_token_ids=[]) for r in requests]
        body = self.payload(unbanned, SamplingParams(temperature=0.0, max_new_tokens=1))
        prompts = body["input_ids"]
        body["input_ids"] = [list(ids) + response for ids, response in zip(prompts, responses)]
        body["logprob_start_len"] = [len(ids) - 1 for ids in prompts]
        if top_k:  # input_top_logprobs: one list of (logprob, id, text) per input position, as the token logprobs
            body["top_logprobs_num"] = top_k
        outputs = self.call_engine("generate", body)
        if len(outputs) != len(requests):
            raise RolloutError(f"{self.name}: {len(outputs)} outputs for {len(requests)} responses to score")
        scores = []
        for request, response, out in zip(requests, responses, outputs):
            entries = out["meta_info"]["input_token_logprobs"]
            tail = [e[1] for e in entries[len(entries) - len(response):]]
            # SGLang reports as 0 every input id >= vocab_size - 1 (meant for image hash values; the last id of the
            # vocabulary too, an off-by-one of its display only: the logprob is that id's)
            if any(seen != given and seen != 0 for seen, given in zip(tail, response)) or len(tail) != len(response):
                raise RolloutError(f"{self.name}: request {request.uid}: the engine's input ends with {tail}, not "
                                   f"with the response {response}")
            what = f"request {request.uid}"
            top = []
            if top_k:
                tops = [None if pos is None else {e[1]: e[0] for e in pos}
                        for pos in out["meta_info"]["input_top_logprobs"]]
                top = response_top_tail(tops, response, self.name, what)
            scores.append(ScoredResponse(response_tail([e[0] for e in entries], response, self.name, what), top))
        return scores

    def captures_routing(self) -> bool:
        return captures_routing(self.rollout, self.name, self.processor.family)

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
            raise ServerSettingError(
                f"{self.name}: the engine returns logprobs after temperature ({h.response_logprobs[0]:.4f} at T=5 "
                f"vs {g.response_logprobs[0]:.4f} raw); start it with SGLANG_RETURN_ORIGINAL_LOGPROB=1")
        if not self.processor.family.engines.sglang_prompt_ids:
            self.check_text_prompts(generate)

    def start_args(self) -> dict[str, Any]:
        """The arguments this backend starts its engine (or server) with; notes what sleep will do."""
        args = with_own_nccl_port(engine_args(self.model_path, self.options, self.processor.family, self.on_cuda,
                                              self.name))
        self.memory_saver = bool(args["enable_memory_saver"])
        self.weights_backed_up = bool(args.get("enable_weights_cpu_backup", False))
        return args

    def releases_memory(self) -> bool:
        return self.memory_saver

    def why_no_release(self) -> str:
        return "rollout.sglang.enable_memory_saver is off" + ("" if self.on_cuda else " (CPU)")

    def _sleep(self) -> bool:
        self.call_engine("release_memory_occupation", {})  # every tag: KV cache, weights, CUDA graphs
        return not self.weights_backed_up  # else they come back from host memory

    def _wake_up(self, tags: list[str]) -> None:
        # SGLang's tags: the KV cache wakes with the CUDA graphs that address it
        sglang_tags = [t for tag in tags for t in ((tag,) if tag == "weights" else (tag, "cuda_graph"))]
        self.call_engine("resume_memory_occupation", {"tags": sglang_tags})

    def call_engine(self, method: str, body: dict) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


def per_step_video_grids(processor: Any, ids: Sequence[int], mm: dict[str, Any]) -> dict[str, Any]:
    """The `processor_output` keys that make sglang 0.5.23's Qwen2.5-VL tower attend within each temporal patch of
    a video, as transformers does (`EngineFacts.sglang_video_per_step_grids`): `video_grid_thw` with one (1, h, w)
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


def _result(out: dict, request: RolloutRequest, sample_index: int, top_k: int,
            routing: RoutingLayout | None = None) -> RolloutResult:
    """One SGLang output -> RolloutResult, with the pad-ban renormalisation undone (see the module docstring).
    `routing`: read the output's routed experts (base64 int32 (tokens, layers, k), `return_routed_experts`)."""
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
    routed = None
    if routing is not None:
        payload = meta.get("routed_experts")
        if payload is None:
            raise RolloutError(f"sglang: request {request.uid}: no routed experts in the output (the engine must "
                               "start with enable_return_routed_experts)")
        routed = routing.from_engine(np.frombuffer(base64.b64decode(payload), dtype=np.int32), "sglang")
    return RolloutResult(uid=request.uid, sample_index=sample_index, response_ids=ids, response_logprobs=logprobs,
                         finish_reason=reason if reason in ("stop", "length") else "abort", top_logprobs=tops,
                         routed_experts=routed)


def _quit_signal_survivor(signum, frame) -> None:
    """SGLang children send SIGQUIT to their parent when they fail; its own handler would kill the whole process
    tree, the trainer included. Log instead: the backend's health check fails its next call."""
    logger.error("an SGLang child process reported a failure (SIGQUIT); the sglang backend will fail its next call")


# ---------------------------------------------------------------------------------------------------- Engine


class SGLangBackend(SGLangWeightGroup, SGLangCommon):
    """SGLang's in-process `Engine` (scheduler and detokenizer in child processes)."""

    name = "sglang"
    accepts_partial_weights = True  # update_weights_from_tensor loads the tensors it is given, by name

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        self.engine = None
        self._runner = DeadlineRunner(self.name, self._health)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, _quit_signal_survivor)
        try:
            self.engine = self._runner.call("start the engine", self._start, self.rollout.start_timeout_s)
            atexit.register(self.close)
            self.check_raw_logprobs(lambda body: self._runner.call("probe", lambda: self.engine.generate(**body),
                                                                   self.rollout.timeout_s))
        except BaseException:
            self.close()  # a failed start must not leave the engine's processes behind
            raise

    def _start(self):
        env = engine_env(self.options, self.on_cuda)
        # Inherited by the scheduler processes spawned below; SGLANG_USE_CPU_ENGINE stays set (this process's
        # sglang reads it too), the two engine settings are put back afterwards.
        if "SGLANG_USE_CPU_ENGINE" in env:
            os.environ["SGLANG_USE_CPU_ENGINE"] = env.pop("SGLANG_USE_CPU_ENGINE")
        with env_override(env):
            route_engine_logs("sglang", self.rollout.sglang.log_level)
            import sglang

            # Built on this engine thread: no signal handlers are installed and the engine's event loop is this
            # thread's, which every later call runs on.
            engine = sglang.Engine(**self.start_args())
        atexit.unregister(engine.shutdown)  # it would kill every child of this process at exit
        watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it SIGQUITs this process when a child dies; our health check reports it instead
        self.engine_pids = list(engine.get_all_child_pids())
        logger.info("sglang: engine up on %s (%s), processes %s", self.model_path,
                    self.options.resolved_dtype(self.processor.family), self.engine_pids)
        return engine

    def _health(self) -> str | None:
        for pid in self.engine_pids:
            if not is_alive(pid):
                return f"an SGLang engine process (pid {pid}: scheduler or detokenizer) has exited"
        return None

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        body = self.payload(requests, sampling)
        outputs = self._runner.call(f"generate {len(requests)} requests", lambda: self.engine.generate(**body),
                                    self.rollout.timeout_s)
        return self.parse(outputs, requests, sampling)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        sync = self.sync_plan(named_tensors, names)
        timeout = self.rollout.timeout_s
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
            self._flush_cache()
        finally:
            self._runner.call("end the weight update", self.engine.end_weight_update, timeout)
        self.weight_version += 1
        logger.debug("sglang: loaded %d tensors (weight version %d); caches flushed", len(sync.names),
                     self.weight_version)

    def _flush_cache(self) -> None:
        """The cache flushed once per load, not per bucket: by a load of no tensors with flush_cache, which clears
        the scheduler's pools as flush_cache does but without the garbage-collection pass flush_cache adds on a CPU
        (measured on the tiny model: 2-5 ms against 0.33 s, of a 0.36-0.42 s sync). Refused, like the loads, while
        requests still run."""
        ok, message = self._runner.call("flush the cache",
                                        lambda: self.engine.update_weights_from_tensor([], flush_cache=True),
                                        self.rollout.timeout_s)[:2]
        if not ok:
            raise RolloutError(f"{self.name}: the cache flush after the weight update was refused: {message}")

    def call_engine(self, method: str, body: dict) -> Any:
        return self._runner.call(method, lambda: getattr(self.engine, method)(**body), self.rollout.timeout_s)

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


