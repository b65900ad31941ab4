"""Generation in segments of a few tokens, so that a weight sync can come between two of them (the asynchronous
placement's trainer.async_rollout.interrupt_tokens): the batch in flight is interrupted at its next segment
boundary, the new weights load, and its unfinished samples go on from where they stopped with them.

    results, versions = generate_in_segments(backend, requests, sampling, segment_tokens=64, version=3, between=...)

Each segment is one `generate` call. The first is the batch itself with max_new_tokens cut to the segment; each
later one continues every sample that is still open (ended by the segment's length, not by a stop token, and short
of sampling.max_new_tokens) as a request of its own: the same request with the sample's tokens so far appended to
its prompt (its images and videos as they were), n = 1. Every sample is then its segments' tokens and logprobs
joined, its finish reason the last segment's. `version` is the version of the weights the engine holds at the start;
`between()` runs before each later segment (the caller lets a waiting sync in there) and returns the version the
engine then holds; `versions` gives each sample's (first, last) one.

Each token's logprob is the one the engine computed when it sampled it, under the weights that sampled it, which is
what rollout correction weights against. Greedy decoding gives the same tokens in segments as in one call (tested);
seeded sampling draws other, equally distributed tokens: each continuation has a seed of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

SEGMENT_SEED_STRIDE = 1_000_003
"""Seed offset of each later segment (a prime): its continuations' seeds do not repeat the first segment's."""


def generate_in_segments(backend, requests: Sequence[RolloutRequest], sampling: SamplingParams, segment_tokens: int,
                         version: int, between: Callable[[], int]
                         ) -> tuple[list[RolloutResult], list[tuple[int, int]]]:
    """Results request-major (n per request, as `backend.generate` gives them) and each result's (first, last)
    weight version; see the module docstring."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens={segment_tokens} must be >= 1")
    total = sampling.max_new_tokens
    results = list(backend.generate(requests, replace(sampling, max_new_tokens=min(segment_tokens, total))))
    versions = [(version, version) for _ in results]
    done_tokens, segment = min(segment_tokens, total), 0
    while done_tokens < total:
        open_rows = [i for i, r in enumerate(results) if r.finish_reason == "length"]
        if not open_rows:
            break
        segment += 1
        version = between()
        step = min(segment_tokens, total - done_tokens)
        continued = [replace(requests[i // sampling.n], uid=f"{results[i].uid}-s{results[i].sample_index}",
                             prompt_ids=[*requests[i // sampling.n].prompt_ids, *results[i].response_ids])
                     for i in open_rows]
        seed = None if sampling.seed is None else sampling.seed + SEGMENT_SEED_STRIDE * segment
        more = backend.generate(continued, replace(sampling, n=1, max_new_tokens=step, seed=seed))
        for i, extra in zip(open_rows, more):
            r = results[i]
            top = None if r.top_logprobs is None else [*r.top_logprobs, *(extra.top_logprobs or [])]
            results[i] = replace(r, response_ids=[*r.response_ids, *extra.response_ids],
                                 response_logprobs=[*r.response_logprobs, *extra.response_logprobs],
                                 finish_reason=extra.finish_reason, top_logprobs=top)
            versions[i] = (versions[i][0], version)
        done_tokens += step
    return results, versions
