"""Batches the turns that concurrent trajectories ask for into as few backend calls as possible.

Each trajectory awaits `TurnBatcher.generate(request, sampling)`. The backend's `generate` is blocking, so it runs in
a thread; while a call is in flight, the turns asked for meanwhile wait and go together into the next call. Turns are
batched when their sampling settings match except `max_new_tokens`: a call asks for the largest, and each result is
cut back to its own turn's limit (finish_reason "length"), which costs a few wasted tokens but keeps calls large.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

SEED_STRIDE = 1_000_003
"""Seeded sampling: call k of a step uses seed + k * SEED_STRIDE, so no two calls draw from the same seeds (the
backend further offsets each request of a call by its position)."""


@dataclass
class _Pending:
    request: RolloutRequest
    sampling: SamplingParams
    future: asyncio.Future
    room: int | None = None
    """Most new tokens this request's context can take (the engine rejects a call asking for more)."""


@dataclass
class BatcherStats:
    """Counts for the step's metrics."""

    calls: int = 0
    requests: int = 0
    cut_tokens: int = 0
    """Tokens generated past a turn's own limit and cut off (the price of batching mixed limits)."""
    withdrawn: int = 0
    """Turns withdrawn before reaching the backend (the step's batch was full)."""
    per_call: list[int] = field(default_factory=list)


def batch_key(sampling: SamplingParams) -> tuple:
    """Turns with equal keys can share one backend call."""
    return (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
            tuple(sampling.stop_token_ids), sampling.top_logprobs)


class TurnBatcher:
    """One per step (one event loop). `generate` returns the request's `sampling.n` results, or None when the turn
    was withdrawn by `withdraw_pending` before it reached the backend."""

    def __init__(self, backend, executor: ThreadPoolExecutor, *, max_in_flight: int = 1, max_requests: int = 0):
        self.backend = backend
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.max_requests = max_requests
        self.stats = BatcherStats()
        self._pending: list[_Pending] = []
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None
        self._calls_started = 0

    async def generate(self, request: RolloutRequest, sampling: SamplingParams,
                       room: int | None = None) -> list[RolloutResult] | None:
        """room: the most new tokens this request's context allows (>= sampling.max_new_tokens); a call that batches
        it never asks for more, since the engine checks prompt + max_new_tokens against its context length."""
        if self._dispatcher is None:
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_loop())
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, sampling, future, room))
        self._wake.set()
        return await future

    def withdraw_pending(self) -> None:
        """Answer every turn not yet sent with None (the trajectory parks without generating)."""
        pending, self._pending = self._pending, []
        for item in pending:
            if not item.future.done():
                item.future.set_result(None)
        self.stats.withdrawn += len(pending)

    async def close(self) -> None:
        """Stop the dispatcher; turns still pending are withdrawn."""
        self.withdraw_pending()
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # let every trajectory that is ready ask for its turn before we cut a batch
            while self._pending and self._in_flight < self.max_in_flight:
                batch = self._take_batch()
                self._in_flight += 1
                asyncio.get_running_loop().create_task(self._run(batch))

    def _take_batch(self) -> list[_Pending]:
        chosen = set(plan_batch([(batch_key(i.sampling), i.sampling.max_new_tokens, i.room) for i in self._pending],
                                self.max_requests))
        batch = [item for j, item in enumerate(self._pending) if j in chosen]
        self._pending = [item for j, item in enumerate(self._pending) if j not in chosen]
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        first = batch[0].sampling
        seed = None if first.seed is None else first.seed + self._calls_started * SEED_STRIDE
        self._calls_started += 1
        sampling = dataclasses.replace(first, seed=seed, max_new_tokens=max(i.sampling.max_new_tokens for i in batch))
        requests = [item.request for item in batch]
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.backend.generate, requests, sampling)
            if len(results) != len(requests) * sampling.n:
                raise RuntimeError(f"backend returned {len(results)} results for {len(requests)} requests x "
                                   f"n={sampling.n}")
            self.stats.calls += 1
            self.stats.requests += len(requests)
            self.stats.per_call.append(len(requests))
            for j, item in enumerate(batch):
                own = results[j * sampling.n:(j + 1) * sampling.n]
                mine = [self._cut(r, item.sampling.max_new_tokens) for r in own]
                if not item.future.done():
                    item.future.set_result(mine)
        except Exception as err:  # the backend failed: every turn of this call sees the error (a step failure)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)
        finally:
            self._in_flight -= 1
            self._wake.set()

    def _cut(self, result: RolloutResult, limit: int) -> RolloutResult:
        if len(result.response_ids) <= limit:
            return result
        self.stats.cut_tokens += len(result.response_ids) - limit
        top = None if result.top_logprobs is None else result.top_logprobs[:limit]
        return dataclasses.replace(result, response_ids=result.response_ids[:limit],
                                   response_logprobs=result.response_logprobs[:limit], finish_reason="length",
                                   top_logprobs=top)



def plan_batch(items: list[tuple[tuple, int, int | None]], max_requests: int = 0) -> list[int]:
    """Which pending turns go into the next call, in arrival order: (key, max_new_tokens, room) per turn.

    The first turn always goes; a later one joins when its key matches, the call is not full, and the call's
    max_new_tokens (the largest limit) still fits every member's room.

    >>> plan_batch([("a", 64, None), ("b", 64, None), ("a", 16, 20), ("a", 32, 200)])
    [0, 3]
    >>> plan_batch([("a", 8, 10), ("a", 64, None), ("a", 10, 500)])
    [0, 2]
    """
    key, limit, room = items[0]
    chosen = [0]
    for j, (other_key, other_limit, other_room) in enumerate(items[1:], start=1):
        if max_requests and len(chosen) >= max_requests:
            break
        new_limit = max(limit, other_limit)
        rooms = [r for r in (room, other_room) if r is not None]
        if other_key == key and all(new_limit <= r for r in rooms):
            chosen.append(j)
            limit, room = new_limit, (min(rooms) if rooms else None)
    return chosen
