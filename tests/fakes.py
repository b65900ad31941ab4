"""A rollout backend without a model, for tests of the logic around rollouts (the agent loop, turn batching, partial
rollout, carried groups) that needs tokens but not an engine's numbers. Tests whose point is what an engine
computes (logprobs, greedy equality with hf, weight sync) keep the real engines.

    with ScriptedBackend(tiny_model_path, lambda request, sample: [id_a, id_b, eos]) as backend:
        results = backend.generate(requests, SamplingParams(n=2, max_new_tokens=8))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from vlmrl.rollout.base import BackendOptions, RolloutBackend
from vlmrl.rollout.requests import finish_at_stop
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

Respond = Callable[[RolloutRequest, int], Sequence[int]]
"""(request, sample index) -> the token ids the model writes after request.prompt_ids (cut by the backend)."""


class ScriptedBackend(RolloutBackend):
    """Writes what `respond` says, cut like every engine cuts: right after the first stop token (the model's EOS ids
    and `sampling.stop_token_ids`, kept) or at `max_new_tokens`. Each token's logprob is `logprob`; top-k lists hold
    just the written token. Requests are checked as by every backend (`check_requests`: placeholders, image limits,
    lengths) and its results as every backend's (`check_results`: a banned token in a response fails the call), so a
    script cannot produce what no engine may.

    Calls run one at a time, each taking `latency_s` (as an engine's forward takes time): a caller that batches
    whatever is ready (the agent loop's turn batcher) then batches alike in every run, since everything ready at
    the event loop has queued up before a call returns. `calls` records each generate call as (requests, sampling);
    `weight_syncs` counts update_weights calls."""

    name = "scripted"

    def __init__(self, model_path: str, respond: Respond, *, logprob: float = -0.5, latency_s: float = 0.0,
                 **options: Any):
        super().__init__(model_path, BackendOptions.from_kwargs(self.name, options))
        self.respond, self.logprob, self.latency_s = respond, logprob, latency_s
        self._one_at_a_time = threading.Lock()
        self.calls: list[tuple[list[RolloutRequest], SamplingParams]] = []
        self.weight_syncs = 0

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        with self._one_at_a_time:
            time.sleep(self.latency_s)
            return self._write(requests, sampling)

    def _write(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        self.calls.append((list(requests), sampling))
        stop_ids = set(self.processor.eos_token_ids) | set(sampling.stop_token_ids)
        results = []
        for request in requests:
            for i in range(sampling.n):
                ids, reason = finish_at_stop(list(self.respond(request, i))[: sampling.max_new_tokens], stop_ids)
                tops = [{t: self.logprob} for t in ids] if sampling.top_logprobs else None
                results.append(RolloutResult(uid=request.uid, sample_index=i, response_ids=ids,
                                             response_logprobs=[self.logprob] * len(ids), finish_reason=reason,
                                             top_logprobs=tops))
        return results

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        self.sync_state(named_tensors)  # the same name checks as a real sync
        self.weight_syncs += 1

    def close(self) -> None:
        pass
