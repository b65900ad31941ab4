"""The rollout engines inside the training workers, seen by the fit loop and validation as one rollout backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vlmrl.distributed.group import DistributedActor
from vlmrl.rollout.base import RolloutBackend
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams


class ColocatedEngines(RolloutBackend):
    """`generate` splits the requests over the workers' engines (data-parallel; results request-major);
    `update_weights` loads the given weights into every engine. Closing it closes the whole `DistributedActor`
    (the engines live in its workers).

    The workers' engines free their memory while their actor trains (`TrainWorker`), so this backend itself never
    sleeps. `update_weights(actor.named_tensors())` works, but gathers the weights to the driver and sends them back; the
    fit loop's `actor.sync_weights(backend)` does the same without the weights leaving the workers.
    """

    def __init__(self, actor: DistributedActor):
        engine = actor.spec.engine
        if engine is None:
            raise ValueError("the DistributedActor was built without a rollout engine (WorkerSpec.engine)")
        super().__init__(engine.model_path, engine.options)
        self.name = engine.name  # artifacts and logs name the real engine
        self.actor = actor
        self.dtype = engine_dtype(actor.engine_dtypes, self.dtype, self.name)

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        return self.actor.generate(list(requests), sampling)  # requests checked here, before any worker sees them

    def generate_on_each(self, requests: Sequence[RolloutRequest], sampling: SamplingParams
                         ) -> list[list[RolloutResult]]:
        self.check_requests(requests, sampling)
        return self.actor.generate(list(requests), sampling, on_each=True)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        self.actor.load_engine_weights(list(named_tensors))

    def close(self) -> None:
        self.actor.close()


def engine_dtype(reported: list[str], here: str, name: str) -> str:
    """The dtype of engines that run in other processes, as they resolved it where they run (`auto` depends on
    whether THAT process sees a GPU, not the driver); `here` (the driver's resolution) only when none reported.

    >>> engine_dtype(["bfloat16"], "float32", "vllm"), engine_dtype([], "float32", "vllm")
    ('bfloat16', 'float32')
    """
    if len(set(reported)) > 1:
        raise RuntimeError(f"{name}: the rollout engines run in different dtypes {sorted(set(reported))}: give "
                           "rollout.dtype explicitly")
    return reported[0] if reported else here
