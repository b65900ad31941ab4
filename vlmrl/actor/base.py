"""What the fit loop sees of the policy: the `PolicyActor` protocol.

Two classes implement it: the single-process `vlmrl.actor.local.Actor` and the driver side of the sharded one,
`vlmrl.distributed.group.DistributedActor` (Ray workers, FSDP2). Both run the same construction (`vlmrl.actor.policy`) and
the same logprob pass and update loop (`vlmrl.actor.core`), so the loop needs no `isinstance` and dp=1 equals dp=N.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from vlmrl.rollout.base import RolloutBackend
from vlmrl.types import TrainBatch


@runtime_checkable
class PolicyActor(Protocol):
    """The policy being trained, its optimizer and (with the KL loss) its frozen reference."""

    dp_size: int
    """Data-parallel ranks: 1 for the single-process actor. Batches must divide by it (padding rows)."""

    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, with_entropy: bool = False,
                         record_routing: bool = False, teacher: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) logprobs of the response tokens (0 on padding) and, optionally, their (B, R) entropy;
        `reference=True` uses the frozen reference, `teacher=True` the distillation teacher (algorithm.distill);
        `record_routing`: a MoE policy's routing kept per row in `batch.routed_experts` (the old-logprob pass;
        sharded: gathered back in batch order)."""
        ...

    def teacher_top_logprobs(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trainer-side distillation teacher's (B, R) logprobs of the sampled tokens and its k most likely
        tokens' (B, R, k) logprobs and ids at each response position (algorithm.distill.estimator=forward_kl_topk);
        one device only for now (the config refuses it at dp > 1)."""
        ...

    def needs_old_logprobs(self, batch_rows: int) -> bool:
        """False when a batch of `batch_rows` rows gets exactly one optimizer step: the update forward's own
        (detached) logprobs are then the old ones, and `update` takes `old_logprobs=None`."""
        ...

    def update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
               old_from_engine: bool = False) -> dict[str, float]:
        """The policy-loss update over the batch (B rows, a multiple of the mini-batch; its response_mask is the
        loss mask), the loss matrix times `loss_weights` (B, R) when given (rollout correction); `old_from_engine`:
        old_logprobs are the engine's (algorithm.rollout_correction=bypass), so the trainer/engine comparisons take
        the update's own forward instead; returns its
        metrics."""
        ...

    def supervised_step(self, batch: TrainBatch, optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step of token-mean NLL of the response tokens (the format warm-up); returns the loss."""
        ...

    def sync_weights(self, backend: RolloutBackend) -> None:
        """The current weights into the rollout engines behind `backend`."""
        ...

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight."""
        ...

    def full_model(self) -> torch.nn.Module:
        """The policy as a plain HF model with the current weights (for `save_pretrained`; LoRA: merged)."""
        ...

    def save_adapter(self, folder: Path) -> None:
        """With LoRA: the PEFT adapter (weights + adapter_config.json) into `folder`/adapter; nothing without."""
        ...

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the weights are saved in HF format beside it)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict()`'s result."""
        ...
