"""The rollout interface every backend implements, the checks every request passes before an engine sees it, and
the deadline runner every engine call goes through.

Contract shared by all backends (`hf`, `vllm`, `sglang`, `sglang-server`):
  - `generate(requests, sampling)` returns `len(requests) * sampling.n` results, request-major (all n samples of
    request 0, then request 1, ...).
  - Logprobs are of the RAW model distribution: log_softmax of the model's logits over the whole vocabulary, before
    temperature, top-p/top-k and before the pad-token ban (what the trainer recomputes). Top-k lists rank the
    tokens that may be sampled (banned ids are left out) with those same raw values.
  - `request.banned_token_ids` (the image/video pad tokens) are never sampled.
  - Every engine call runs under `timeout_s`; a dead engine process raises `EngineDeadError` naming the backend.
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from vlmrl.models.families import ModelFamily, read_model_config
from vlmrl.rollout.config import EngineOptions
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.executor import DaemonExecutor, DeadlineExceeded

logger = logging.getLogger(__name__)

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Engine dtypes by name (`RolloutOptions.resolved_dtype`)."""


class RolloutError(RuntimeError):
    """An engine call failed; the message starts with the backend's name."""


class EngineDeadError(RolloutError):
    """The engine (or server) process is gone; the backend cannot be used again: close it and start a new one."""


class EngineTimeoutError(RolloutError):
    """An engine call ran past its deadline; the backend is considered broken from then on."""


class InvalidRequestError(ValueError):
    """A request that no engine may receive (placeholder/image mismatch, overlong, bad sampling settings).
    Raised before anything reaches the engine; the message names the request."""


# ---------------------------------------------------------------------------------------------------- options


@dataclass
class RolloutOptions(EngineOptions):
    """Options every backend takes (`get_backend(name, model_path, **options)`): the rollout section's engine options
    (`vlmrl.rollout.config.EngineOptions`) plus what a run derives. Names follow verl/EasyR1."""

    max_model_len: int = 4096
    """Longest prompt (expanded, one token per merged image patch) + response the engine must hold."""
    seed: int = 0
    """Engine seed (vLLM `seed`, SGLang `random_seed`, torch for hf); per-request seeds come from SamplingParams."""

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if torch.cuda.is_available() else "float32"

    @classmethod
    def from_kwargs(cls, backend: str, options: dict[str, Any]) -> RolloutOptions:
        """Build from keyword options; an unknown key raises naming the backend and the keys it takes."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{backend}: unknown option(s) {unknown}; this backend takes {sorted(known)} "
                            "(engine-specific arguments go in engine_kwargs)")
        return cls(**options)


# ---------------------------------------------------------------------------------------------------- the interface


class RolloutBackend(abc.ABC):
    """One rollout engine behind the shared contract (see the module docstring). Use as a context manager."""

    name: str = "base"
    options_class: type[RolloutOptions] = RolloutOptions
    accepts_partial_weights: bool = False
    """`update_weights` may be given some of the weights only (the others stay): a LoRA policy's merged sync then
    sends only the adapted layers. False: every weight, every time."""

    def __init__(self, model_path: str, options: RolloutOptions):
        from vlmrl.processors import load_processor

        self.model_path = model_path
        self.options = options
        # The processor owns token ids and image geometry; the same one builds the requests.
        self.processor = load_processor(model_path)
        self.engine_pids: list[int] = []
        """The processes the engine runs in (empty when it runs in this process): watched while waiting on calls,
        and the only processes close() ends."""
        self._logged_once: set[str] = set()
        self._checkpoint_names: set[str] | None = None

    @abc.abstractmethod
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """`len(requests) * sampling.n` results, request-major. Raises InvalidRequestError before the engine for a
        bad request, RolloutError (EngineDeadError / EngineTimeoutError) when the engine fails."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
                       ) -> None:
        """Load these weights into the engine (transformers-5 in-memory names `model.language_model.*` /
        `model.visual.*`, or the names of the model's checkpoint; mapped through the model's family), a bucket of rollout.sync_bucket_mb at a time, and drop
        every cache computed with the old ones. `names`: the names `named_tensors` will give, in order, for a stream
        read only once (`weight_sync`); None = `named_tensors` is read into a list of references first."""

    def serves_adapters(self) -> bool:
        """Whether `update_adapter` works: the engine was started to serve LoRA adapters (vLLM with enable_lora)."""
        return False

    def update_adapter(self, folder: str) -> None:
        """Generate under this PEFT LoRA adapter folder from now on (replacing the previous one), every cache of
        results computed under the old one dropped. Only where `serves_adapters()`."""
        raise NotImplementedError(f"{self.name}: this backend does not serve LoRA adapters; sync merged weights")

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (where the engine can); otherwise log once and carry on."""
        self.log_once("sleep", f"{self.name}: sleep() is not supported here; the engine keeps its memory")

    def wake_up(self) -> None:
        """Undo `sleep()`."""
        self.log_once("wake_up", f"{self.name}: wake_up() is not supported here; nothing to do")

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine and every process it started (only those). Safe to call twice."""

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync_plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None,
                  whole: bool = False) -> WeightSync:
        """What `update_weights` loads (`weight_sync`): the names, then buckets of rollout.sync_bucket_mb in the
        engine's dtype; `whole`: one bucket."""
        if self._checkpoint_names is None:
            self._checkpoint_names = checkpoint_names(self.model_path)
        bucket_bytes = 0 if whole else int(self.options.sync_bucket_mb * 2**20)
        return weight_sync(named_tensors, names, self._checkpoint_names, DTYPES[self.options.resolved_dtype()],
                           bucket_bytes, self.name, self.processor.family)

    def sync_state(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every tensor `update_weights` would load, at once: {checkpoint name: CPU tensor}."""
        return {k: v for bucket in self.sync_plan(named_tensors, whole=True).buckets for k, v in bucket.items()}

    def log_once(self, key: str, message: str) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            logger.warning(message)

    def check_requests(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> None:
        """Reject what no engine may receive, naming the request (see `validate_requests`)."""
        validate_requests(requests, sampling, image_token_id=self.processor.image_token_id,
                          video_token_id=self.processor.video_token_id,
                          tokens_per_image=self.processor.image_token_count,
                          tokens_per_video=self.processor.video.token_count,
                          image_factor=self.processor.image_factor,
                          max_model_len=self.options.max_model_len, limit_images=self.options.limit_images,
                          limit_videos=self.options.limit_videos,
                          backend=self.name)


# ---------------------------------------------------------------------------------------------------- request checks


def describe(request: RolloutRequest, position: int) -> str:
    """How errors name a request: its position in the batch, uid and dataset row."""
    row = f", dataset row {request.index}" if request.index >= 0 else ""
    return f"request {position} (uid {request.uid}{row})"


def validate_requests(
    requests: Sequence[RolloutRequest], sampling: SamplingParams, *, image_token_id: int, video_token_id: int,
    tokens_per_image: Callable[[Any], int], image_factor: int, max_model_len: int, limit_images: int,
    backend: str, tokens_per_video: Callable[[Any], int] | None = None, limit_videos: int = 0,
) -> None:
    """Raise InvalidRequestError for the first request an engine must not see:
    a placeholder count that differs from the image count (an engine would hang, crash or misalign images),
    a `<|video_pad|>` count that differs from the video count, videos whose frames are not (T, H, W, 3) uint8 with T
    even and sides multiples of `image_factor`, images that are not RGB or not resized to multiples
    of `image_factor` (each engine would resize differently), more images than `limit_images`, an empty prompt, or
    an expanded prompt + max_new_tokens over `max_model_len` (never truncated: that would cut through an image).
    Bad sampling settings raise too."""
    _validate_sampling(sampling, backend)
    for position, request in enumerate(requests):
        name = describe(request, position)
        if not request.prompt_ids:
            raise InvalidRequestError(f"{backend}: {name}: empty prompt")
        placeholders = sum(1 for t in request.prompt_ids if t == image_token_id)
        if placeholders != len(request.images):
            raise InvalidRequestError(
                f"{backend}: {name}: {placeholders} <|image_pad|> placeholders in prompt_ids but "
                f"{len(request.images)} images; build requests with vlmrl.processors (one placeholder per image)")
        video_placeholders = sum(1 for t in request.prompt_ids if t == video_token_id)
        if video_placeholders != len(request.videos):
            raise InvalidRequestError(
                f"{backend}: {name}: {video_placeholders} <|video_pad|> placeholders in prompt_ids but "
                f"{len(request.videos)} videos; build requests with vlmrl.processors (one placeholder per video)")
        for i, video in enumerate(request.videos):
            f = video.frames
            if (f.ndim != 4 or f.shape[3] != 3 or f.dtype.name != "uint8" or f.shape[0] % 2 or f.shape[1] % image_factor
                    or f.shape[2] % image_factor or len(video.frame_indices) != f.shape[0]):
                raise InvalidRequestError(
                    f"{backend}: {name}: video {i} frames are {f.dtype} {tuple(f.shape)} ({len(video.frame_indices)} "
                    f"indices); requests carry (T, H, W, 3) uint8 frames, T even, sides multiples of {image_factor} "
                    "(vlmrl.processors does this)")
        if len(request.videos) > limit_videos:
            raise InvalidRequestError(f"{backend}: {name}: {len(request.videos)} videos > limit_videos="
                                      f"{limit_videos}; raise limit_videos")
        if len(request.images) > limit_images:
            raise InvalidRequestError(f"{backend}: {name}: {len(request.images)} images > limit_images="
                                      f"{limit_images}; raise limit_images")
        for i, image in enumerate(request.images):
            if image.mode != "RGB" or image.width % image_factor or image.height % image_factor:
                raise InvalidRequestError(
                    f"{backend}: {name}: image {i} is {image.mode} {image.width}x{image.height}; requests carry RGB "
                    f"images resized to multiples of {image_factor} (vlmrl.processors does this)")
        expanded = len(request.prompt_ids) - placeholders + sum(tokens_per_image(im) for im in request.images)
        if tokens_per_video is not None:
            expanded += sum(tokens_per_video(v) - 1 for v in request.videos)
        if expanded + sampling.max_new_tokens > max_model_len:
            raise InvalidRequestError(
                f"{backend}: {name}: prompt of {expanded} tokens (expanded) + max_new_tokens="
                f"{sampling.max_new_tokens} > max_model_len={max_model_len}; raise max_model_len or filter the row")


def _validate_sampling(sampling: SamplingParams, backend: str) -> None:
    problems = []
    if sampling.n < 1:
        problems.append(f"n={sampling.n} (>= 1)")
    if sampling.temperature < 0:
        problems.append(f"temperature={sampling.temperature} (>= 0; 0 = greedy)")
    if not 0 < sampling.top_p <= 1:
        problems.append(f"top_p={sampling.top_p} (in (0, 1])")
    if sampling.top_k == 0 or sampling.top_k < -1:
        problems.append(f"top_k={sampling.top_k} (-1 disables, else >= 1)")
    if sampling.max_new_tokens < 1:
        problems.append(f"max_new_tokens={sampling.max_new_tokens} (>= 1)")
    if sampling.top_logprobs < 0:
        problems.append(f"top_logprobs={sampling.top_logprobs} (>= 0)")
    if problems:
        raise InvalidRequestError(f"{backend}: invalid sampling settings: {', '.join(problems)}")


def sample_seed(sampling: SamplingParams, request_position: int) -> int | None:
    """Seed of sample 0 of the request at this batch position: seed + position * n (sample i adds i), so that
    two requests with the same prompt in one batch still draw different samples. None when unseeded."""
    return None if sampling.seed is None else sampling.seed + request_position * sampling.n


# ---------------------------------------------------------------------------------------------------- results


def finish_at_stop(token_ids: Sequence[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Cut a response right after its first stop token (kept): (ids, 'stop'), else (ids, 'length')."""
    for i, token in enumerate(token_ids):
        if token in stop_ids:
            return list(token_ids[: i + 1]), "stop"
    return list(token_ids), "length"


def top_allowed(candidates: dict[int, float], k: int, banned: Iterable[int]) -> dict[int, float]:
    """The k highest-logprob candidates that are not banned, best first."""
    banned = set(banned)
    ranked = sorted(((lp, t) for t, lp in candidates.items() if t not in banned), key=lambda x: -x[0])
    return {t: lp for lp, t in ranked[:k]}


def assert_nothing_banned(results: Sequence[RolloutResult], requests: Sequence[RolloutRequest], n: int,
                          backend: str) -> None:
    """Last line of defence: a banned token in an output means the engine ignored the ban; fail loudly."""
    for j, request in enumerate(requests):
        banned = set(request.banned_token_ids)
        for result in results[j * n:(j + 1) * n]:
            hit = banned.intersection(result.response_ids)
            if hit:
                raise RolloutError(f"{backend}: {describe(request, j)} sample {result.sample_index} contains banned "
                                   f"token(s) {sorted(hit)}: the engine did not honour the ban")


# ---------------------------------------------------------------------------------------------------- weights


TIED_COPIES = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
"""Transformers-5 name of a tensor that tied-embedding models (Qwen2.5-VL-3B, Qwen3-VL-2B/4B) share with another ->
that other one. Their checkpoints hold only the latter (save_pretrained drops the copy), while transformers'
state_dict() lists both."""


def tied_copies(family: ModelFamily) -> dict[str, str]:
    """TIED_COPIES in the checkpoint names of this family.

    >>> from vlmrl.models.families import QWEN2_5_VL, QWEN3_VL
    >>> tied_copies(QWEN2_5_VL), tied_copies(QWEN3_VL)
    ({'lm_head.weight': 'model.embed_tokens.weight'}, {'lm_head.weight': 'model.language_model.embed_tokens.weight'})
    """
    return {family.checkpoint_name(copy): family.checkpoint_name(source) for copy, source in TIED_COPIES.items()}


@dataclass
class WeightSync:
    """What one `update_weights` call loads: every checkpoint name, known before the first tensor is read (so a
    backend can refuse a wrong set before its engine sees anything), and the tensors in buckets."""

    names: set[str]
    """Checkpoint names the buckets will hold (tied copies the checkpoint does not hold left out)."""
    buckets: Iterator[dict[str, torch.Tensor]]
    """{checkpoint name: contiguous CPU tensor in the engine's dtype}, each bucket at most the bucket size (a larger
    tensor alone); lazily read: a gathering actor gathers as the buckets are consumed."""


def weight_sync(named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None,
                model_names: set[str], dtype: torch.dtype | None, bucket_bytes: int, backend: str,
                family: ModelFamily) -> WeightSync:
    """Plan a bucketed weight sync (rollout.sync_bucket_mb): names checked first, then tensors cast to the engine's
    `dtype` (floating ones), moved to the CPU and grouped `bucket_bytes` at a time, so host memory holds about one
    bucket however large the model. bucket_bytes <= 0: one bucket of everything.

    Args:
        named_tensors: (transformers or checkpoint name, tensor) pairs, read once, in order.
        names: their names in that order, when `named_tensors` is a stream that must not be read twice (a sharded
            actor gathers each tensor as it is read); None = read `named_tensors` into a list of references first.
        model_names: the checkpoint names of the engine's model (`checkpoint_names`); empty = unknown.
        dtype: the engine's dtype; None = as given.
        family: the model's family: its checkpoint names are what the engine loads.

    A tied copy the checkpoint does not hold (`tied_copies(family)`) is left out; one that differs from the tensor it is tied
    to is refused (the engine has one tensor for both): before anything is sent when the values are at hand, else
    when the copy is read.
    """
    if names is None:
        named_tensors = list(named_tensors)  # references to tensors that exist anyway: no copy
        names = [name for name, _ in named_tensors]
        values = {family.checkpoint_name(name): tensor for name, tensor in named_tensors}
    else:
        values = None
    keys = [family.checkpoint_name(name) for name in names]
    if not keys:
        raise ValueError("update_weights got no tensors")
    seen: set[str] = set()
    for name, key in zip(names, keys):
        if key in seen:
            raise ValueError(f"weight {key!r} given twice (as {name!r})")
        seen.add(key)
    dropped = {copy: source for copy, source in tied_copies(family).items()
               if model_names and copy not in model_names and copy in seen and source in seen}
    if values is not None:
        for copy, source in dropped.items():
            if not torch.equal(values[copy].to(values[source].dtype), values[source]):
                raise ValueError(_untied(copy, source, backend))
    return WeightSync(seen - set(dropped), _buckets(named_tensors, keys, dropped, dtype, bucket_bytes, backend,
                                                        family))


def _untied(copy: str, source: str, backend: str) -> str:
    return (f"{backend}: the model ties {copy} to {source} (its checkpoint holds only the latter), but the weights "
            "sent differ: the trainer untied them, which the engine cannot follow")


def _fingerprint(tensor: torch.Tensor) -> bytes:
    """A digest of the tensor's bytes: compares a tied copy with its source without keeping the source."""
    import hashlib

    return hashlib.blake2b(tensor.reshape(-1).view(torch.uint8).numpy(), digest_size=32).digest()


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], keys: list[str], dropped: dict[str, str],
             dtype: torch.dtype | None, bucket_bytes: int, backend: str, family: ModelFamily
             ) -> Iterator[dict[str, torch.Tensor]]:
    sources = {source: copy for copy, source in dropped.items()}
    prints: dict[str, bytes] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    read = 0
    for (name, tensor), key in zip(named_tensors, keys, strict=True):
        read += 1
        if family.checkpoint_name(name) != key:
            raise ValueError(f"{backend}: weight {read} is {name!r}, not the announced {key!r}")
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)  # on the trainer's device: half the bytes to move for a bf16 engine
        tensor = tensor.to("cpu").contiguous()
        if key in sources or key in dropped:
            prints[key] = _fingerprint(tensor)
            pair = (key, sources[key]) if key in sources else (dropped[key], key)
            if all(k in prints for k in pair) and prints[pair[0]] != prints[pair[1]]:
                raise ValueError(_untied(pair[1], pair[0], backend))
            if key in dropped:
                continue
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and bucket_bytes > 0 and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[key] = tensor
        size += nbytes
    if bucket:
        yield bucket


def checkpoint_names(model_path: str) -> set[str]:
    """Names of every tensor in a model folder's safetensors files (headers only, nothing loaded)."""
    from pathlib import Path

    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


# ---------------------------------------------------------------------------------------------------- engine settings


def family_engine_overrides(model_path: str, family: ModelFamily, enabled: bool, backend: str) -> dict[str, Any]:
    """The model config values an engine must start with to compute what transformers computes on `model_path`
    (`ModelFamily.engine_overrides`; empty when its config.json already says so). Logged when not empty: engines
    started outside vlmrl on the same folder would still drift.

    `enabled=False` (rollout.family_engine_settings=false, to reproduce a deployment) passes nothing and warns when
    the engine will therefore disagree with the trainer."""
    model_config = read_model_config(model_path)
    problems = family.engine_problems(model_config)
    if not enabled:
        if problems:
            logger.warning("%s: rollout.family_engine_settings=false: the engine starts on %s as it is and will NOT "
                           "compute what transformers (the trainer) computes:\n  %s", backend, model_path,
                           "\n  ".join(problems))
        return {}
    overrides = family.engine_overrides(model_config)
    if overrides:
        logger.warning("%s: %s; vlmrl starts the engine with the config override %s. Engines started outside vlmrl "
                       "on this folder would still drift: fix its config.json", backend, " ".join(problems),
                       json.dumps(overrides))
    return overrides


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated with `extra`, nested dicts merged key by key (`extra` wins).

    >>> merged({"text_config": {"a": 1, "b": 2}}, {"text_config": {"b": 3}, "c": 4})
    {'text_config': {'a': 1, 'b': 3}, 'c': 4}
    """
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---------------------------------------------------------------------------------------------------- deadlines


class DeadlineRunner:
    """Runs one backend's engine calls, one at a time, on a dedicated daemon thread, each under a deadline.

    While waiting it asks `health()` every `poll_s` (None = alive, else a sentence saying what died), so a dead
    engine process fails the call within about a second instead of at the deadline (SGLang's calls hang forever
    when its scheduler dies). After a timeout or a death every later call fails at once: the thread may still be
    stuck inside the engine. The thread is a daemon so a stuck call never blocks interpreter exit.
    """

    def __init__(self, backend: str, health: Callable[[], str | None] = lambda: None, poll_s: float = 0.5):
        self.backend = backend
        self.health = health
        self.poll_s = poll_s
        self.broken: str | None = None
        self._engine_thread = DaemonExecutor(1, f"vlmrl-{backend}-engine")

    def call(self, what: str, fn: Callable[[], T], timeout_s: float) -> T:
        """fn() on the engine thread; raises EngineDeadError / EngineTimeoutError / RolloutError naming the backend."""
        if self.broken:
            raise EngineDeadError(f"{self.backend}: cannot {what}: the engine is unusable ({self.broken}); "
                                  "close this backend and start a new one")
        self._check_health(what)
        try:
            return self._engine_thread.call(what, fn, timeout_s, check=lambda: self._check_health(what),
                                            poll_s=self.poll_s)
        except DeadlineExceeded:
            self.broken = f"{what} ran past its {timeout_s:g} s deadline"
            raise EngineTimeoutError(f"{self.backend}: {what} did not finish within {timeout_s:g} s "
                                     "(timeout_s); the engine is considered hung") from None
        except (RolloutError, InvalidRequestError):
            raise
        except Exception as err:
            self._check_health(what)
            raise RolloutError(f"{self.backend}: {what} failed: {type(err).__name__}: {err}") from err

    def _check_health(self, what: str) -> None:
        problem = self.health()
        if problem:
            self.broken = problem
            raise EngineDeadError(f"{self.backend}: cannot {what}: {problem}")

    def stop(self) -> None:
        """Let the thread end after its current job (a stuck one stays, as a daemon)."""
        self._engine_thread.shutdown(wait=False)
