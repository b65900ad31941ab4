"""The rollout engines inside the training workers, seen by the fit loop and validation as one rollout backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vlmrl.distributed.group import DistributedActor
from vlmrl.rollout import RolloutBackend, backend_class
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams


class ColocatedEngines(RolloutBackend):
    """`generate` splits the requests over the workers' engines (data-parallel; results request-major);
    `update_weights` loads the given weights into every engine. Closing it closes the whole `DistributedActor`
    (the engines live in its workers).

    `update_weights(actor.named_tensors())` works, but gathers the weights to the driver and sends them back; the
    fit loop's `actor.sync_weights(backend)` does the same without the weights leaving the workers.
    """

    def __init__(self, actor: DistributedActor):
        engine = actor.spec.engine
        if engine is None:
            raise ValueError("the DistributedActor was built without a rollout engine (WorkerSpec.engine)")
        options = backend_class(engine.name).options_class.from_kwargs(engine.name, dict(engine.options))
        super().__init__(engine.model_path, options)
        self.name = engine.name  # artifacts and logs name the real engine
        self.actor = actor

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        self.check_requests(requests, sampling)  # a bad request fails here, naming it, before any worker sees it
        return self.actor.generate(list(requests), sampling)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
                       ) -> None:
        self.actor.load_engine_weights(list(named_tensors))

    def close(self) -> None:
        self.actor.close()
