"""Teacher-forced scoring on a rollout backend: the raw logprob of each given response token after the request's
prompt and the response tokens before it, on the engine's own model, and optionally the top-k tokens of the
distribution at each response position (what an engine-side distillation teacher gives the student's samples).

`RolloutBackend.score` runs the checks here around each backend's own `_score`, as `generate` runs the request and
result checks around `_generate`: the requests are checked as generate checks them (the prompt plus the response
and the one token an engine generates after it must fit max_model_len), a response may hold no image or video
placeholder (an engine would read it as another image), and every scored response comes back with one logprob per
token. How each engine scores: docs/engines.md ("Scoring given tokens").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmrl.rollout.errors import InvalidRequestError, RolloutError
from vlmrl.rollout.requests import describe
from vlmrl.types import RolloutRequest


@dataclass
class ScoredResponse:
    """One scored response: what `RolloutBackend.score_top` gives per request."""

    logprobs: list[float]
    """The raw logprob of each response token after the prompt and the tokens before it."""
    top: list[dict[int, float]] = field(default_factory=list)
    """Per response token, the top_k most likely tokens {id: raw logprob} of the distribution at its position (the
    one it was drawn from); empty when scored with top_k = 0."""


def check_responses(requests: Sequence[RolloutRequest], responses: Sequence[Sequence[int]], placeholder_ids: set[int],
                    backend: str) -> None:
    """Raise InvalidRequestError unless there is one response per request and no response holds a placeholder id."""
    if len(responses) != len(requests):
        raise InvalidRequestError(f"{backend}: score got {len(responses)} responses for {len(requests)} requests "
                                  "(one per request)")
    for position, (request, response) in enumerate(zip(requests, responses)):
        placed = sorted(placeholder_ids.intersection(response))
        if placed:
            raise InvalidRequestError(f"{backend}: {describe(request, position)}: the response to score holds the "
                                      f"image/video placeholder id(s) {placed}, which an engine reads as media, not "
                                      "as a token")


def check_scores(scores: Sequence[ScoredResponse], requests: Sequence[RolloutRequest],
                 responses: Sequence[Sequence[int]], top_k: int, backend: str) -> None:
    """What a backend's `_score` must return: one record per request, one logprob per response token and (top_k >
    0) one top-k of exactly top_k ids per response token."""
    if len(scores) != len(requests):
        raise RolloutError(f"{backend}: {len(scores)} scored responses for {len(requests)} requests")
    for position, (request, response, scored) in enumerate(zip(requests, responses, scores)):
        if len(scored.logprobs) != len(response):
            raise RolloutError(f"{backend}: {describe(request, position)}: {len(scored.logprobs)} logprobs for a "
                               f"response of {len(response)} tokens")
        if top_k and (len(scored.top) != len(response) or any(len(top) != top_k for top in scored.top)):
            raise RolloutError(f"{backend}: {describe(request, position)}: the top-{top_k} logprobs of a response of "
                               f"{len(response)} tokens came as {[len(top) for top in scored.top][:8]} ids per token")


def response_tail(logprobs: Sequence[float | None], response: Sequence[int], backend: str, what: str
                  ) -> list[float]:
    """The last len(response) of an engine's per-position prompt logprobs (the response's own: the engine's
    positions count expanded image tokens, which vlmrl never has to count), each required to be there."""
    tail = list(logprobs[len(logprobs) - len(response):])
    if len(logprobs) < len(response) or any(lp is None for lp in tail):
        raise RolloutError(f"{backend}: {what}: {len(logprobs)} prompt logprobs for a response of {len(response)} "
                           "tokens, or a response token without one")
    return [float(lp) for lp in tail]


def response_top_tail(tops: Sequence[dict[int, float] | None], response: Sequence[int], backend: str, what: str
                      ) -> list[dict[int, float]]:
    """The last len(response) of an engine's per-position prompt top-k logprobs (as `response_tail`), each required
    to be there."""
    tail = list(tops[len(tops) - len(response):])
    if len(tops) < len(response) or any(top is None for top in tail):
        raise RolloutError(f"{backend}: {what}: {len(tops)} prompt top-k logprobs for a response of {len(response)} "
                           "tokens, or a response token without them")
    return [dict(top) for top in tail]
