"""What every request must be before an engine sees it, and what every result must be before a caller sees it:
the checks `RolloutBackend.generate` runs around each backend's own `_generate`, and the small rules every backend
shares (per-request seeds, stop tokens, top-k lists)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from vlmrl.rollout.errors import InvalidRequestError, RolloutError
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams


def describe(request: RolloutRequest, position: int) -> str:
    """How errors name a request: its position in the batch, uid and dataset row."""
    row = f", dataset row {request.index}" if request.index >= 0 else ""
    return f"request {position} (uid {request.uid}{row})"


def validate_requests(
    requests: Sequence[RolloutRequest], sampling: SamplingParams, *, image_token_id: int, video_token_id: int,
    tokens_per_image: Callable[[Any], int], image_factor: int, max_model_len: int, limit_images: int,
    backend: str, tokens_per_video: Callable[[Any], int] | None = None, limit_videos: int = 0,
    new_tokens: Sequence[int] | None = None,
) -> None:
    """Raise InvalidRequestError for the first request an engine must not see:
    a placeholder count that differs from the image count (an engine would hang, crash or misalign images),
    a `<|video_pad|>` count that differs from the video count, videos whose frames are not (T, H, W, 3) uint8 with T
    even and sides multiples of `image_factor`, images that are not RGB or not resized to multiples
    of `image_factor` (each engine would resize differently), more images than `limit_images`, an empty prompt, or
    an expanded prompt + max_new_tokens over `max_model_len` (never truncated: that would cut through an image).
    Bad sampling settings raise too. `new_tokens`: per request, the tokens that follow the prompt instead of
    max_new_tokens (a response to score and the one token generated after it)."""
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
        after, what = ((sampling.max_new_tokens, "max_new_tokens") if new_tokens is None
                       else (new_tokens[position], "response + 1 generated"))
        if expanded + after > max_model_len:
            raise InvalidRequestError(
                f"{backend}: {name}: prompt of {expanded} tokens (expanded) + {what}={after} > "
                f"max_model_len={max_model_len}; raise max_model_len or filter the row")


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




def numbered_engines(results: list[RolloutResult], run_sizes: Sequence[int], n: int,
                     engines: Sequence[int] | None = None) -> list[RolloutResult]:
    """Results of requests cut into contiguous runs, one run per engine (`run_sizes` requests each, n results per
    request, request-major), each tagged with its engine's index (`engines[k]` for run k; default k); untouched
    when there is one engine and `engines` does not name it (a backend of several engines names them also when one
    of them took every request).

    >>> r = [RolloutResult(f"u{i}", 0, [1], [0.0], "stop") for i in range(3)]
    >>> [x.engine for x in numbered_engines(r, [2, 1], 1)], [x.engine for x in numbered_engines(r, [3], 1)]
    ([0, 0, 1], [None, None, None])
    >>> [x.engine for x in numbered_engines(r, [3], 1, engines=[1])]
    [1, 1, 1]
    """
    if len(run_sizes) < 2 and engines is None:
        return results
    if len(results) != n * sum(run_sizes):
        raise ValueError(f"{len(results)} results for {sum(run_sizes)} requests at n = {n}")
    numbers = list(engines) if engines is not None else list(range(len(run_sizes)))
    tags = [numbers[k] for k, size in enumerate(run_sizes) for _ in range(size * n)]
    return [replace(result, engine=k) for result, k in zip(results, tags)]


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



def check_results(results: Sequence[RolloutResult], requests: Sequence[RolloutRequest], sampling: SamplingParams,
                  backend: str) -> None:
    """The shape every backend's results must have: `len(requests) * n`, request-major with sample indices 0..n-1,
    one logprob (and one top-k list, when asked) per response token, a known finish reason, and no banned token."""
    n = sampling.n
    if len(results) != len(requests) * n:
        raise RolloutError(f"{backend}: {len(results)} results for {len(requests)} requests x n={n}")
    for j, request in enumerate(requests):
        for i, result in enumerate(results[j * n:(j + 1) * n]):
            name = f"{describe(request, j)} sample {i}"
            if result.uid != request.uid or result.sample_index != i:
                raise RolloutError(f"{backend}: {name}: result is uid {result.uid} sample {result.sample_index}: "
                                   "results must be request-major")
            if len(result.response_logprobs) != len(result.response_ids):
                raise RolloutError(f"{backend}: {name}: {len(result.response_logprobs)} logprobs for "
                                   f"{len(result.response_ids)} tokens")
            if sampling.top_logprobs and (result.top_logprobs is None
                                          or len(result.top_logprobs) != len(result.response_ids)):
                raise RolloutError(f"{backend}: {name}: top_logprobs={sampling.top_logprobs} asked, but the result "
                                   "has no top-k list per token")
            if result.finish_reason not in ("stop", "length", "abort"):
                raise RolloutError(f"{backend}: {name}: finish_reason {result.finish_reason!r}")
    assert_nothing_banned(results, requests, n, backend)
