"""One rank's share of the actor: the policy (and frozen reference) sharded with FSDP2, logprobs and the GRPO update.

Runs inside a training worker (`vlmrl.distributed.worker`); with world_size 1 nothing is sharded. Construction
(`vlmrl.actor.policy.build_policy`), the logprob pass and the update loop (`vlmrl.actor.core.ActorCore`) are the
single-process actor's; what differs is the FSDP2 wrapping and what this class feeds the loop:
- the loss divides by the GLOBAL mini-batch's normaliser / world_size, so the ranks' averaged gradient is exactly the
  single-process one (each rank's own token mean was measured off by 0.1 in gradient);
- no local skips: a micro-batch without policy tokens on this rank still runs forward and backward (the other ranks'
  collectives wait for it); every forward runs the vision tower (`VisionAlwaysOn`);
- the gradient norm and the full weights are collectives over the shards. Why: docs/distributed.md."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vlmrl.actor.config import ActorConfig
from vlmrl.actor.core import ActorCore
from vlmrl.actor.policy import build_policy
from vlmrl.algorithms.config import DistillConfig
from vlmrl.distributed.fsdp import clip_grad_norm, iter_full_state_dict, shard_model
from vlmrl.distributed.vision import WRAPPED_PREFIX, VisionAlwaysOn
from vlmrl.types import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class UpdateShard:
    """One rank's rows of a training batch, laid out mini-batch by mini-batch, and what its loss needs.

    Rank r holds, for every global mini-batch m, the r-th of `world_size` equal slices of it: row block m of this
    shard (`local_mini_batch` rows) belongs to global mini-batch m.
    """

    batch: TrainBatch
    """The rank's rows (b = num_mini_batches * local_mini_batch)."""
    old_logprobs: torch.Tensor | None
    """(b, R) logprobs of the policy that generated the rows; None when the batch gets exactly one optimizer step
    (the update forward's own detached logprobs are then the old ones: ratio 1)."""
    advantages: torch.Tensor
    """(b,) sequence advantages (computed by the driver over whole groups; 0 on padding rows), or (b, R) per-token
    ones (on-policy distillation's advantage mode)."""
    ref_logprobs: torch.Tensor | None
    """(b, R) reference logprobs when the KL loss is on."""
    mini_batch_normalisers: list[float]
    """`loss_normaliser` of each GLOBAL mini-batch (all ranks) for actor.loss_agg_mode; the loss divides by it / world."""
    mini_batch_tokens: list[float]
    """Policy-token count of each GLOBAL mini-batch (all ranks); weighs the token-mean metrics."""
    local_mini_batch: int
    """Rows of this shard per mini-batch."""
    loss_weights: torch.Tensor | None = None
    """(b, R) rollout-correction weights of the rows (None = 1)."""


class ShardedActor(ActorCore):
    """The policy (and reference) on this rank. Construct on every rank with the same arguments, after the
    process group is up (`vlmrl.distributed.fsdp.init_process_group`)."""

    def __init__(self, config: ActorConfig, world_size: int, temperature: float = 1.0, init_path: str | None = None,
                 total_steps: int = 1, distill: DistillConfig | None = None):
        """
        Args:
            config: actor settings (model, optimizer, clip ratios, KL, micro-batch size...).
            world_size: ranks in the group (1 = no sharding).
            temperature: logprobs are of softmax(logits / temperature), the distribution the policy sampled.
            init_path: weights to start from instead of config.model_path (a checkpoint); the reference is always
                config.model_path.
            total_steps: training steps (the lr schedule's length, as for the single-process actor).
            distill: on-policy distillation: with a teacher, its shard is loaded here and sharded as the reference.
        """
        self.world_size = world_size

        def shard(model: torch.nn.Module, offload: bool = config.offload.params) -> torch.nn.Module:
            # sharding replaces the parameters by DTensors: build_policy builds the optimizer on the sharded ones
            return shard_model(VisionAlwaysOn(model), world_size, offload=offload)

        if world_size == 1 and config.offload.params:
            logger.warning("actor.offload.params needs FSDP sharding (dp >= 2): one rank keeps its parameters on "
                           "its device")
        super().__init__(config, build_policy(config, total_steps, init_path, wrap=shard,
                                              wrap_reference=lambda m: shard(m, config.offload.reference),
                                              distill=distill), temperature)

    def agree_count(self, count: int) -> int:
        """The most micro-batches any rank plans (a collective): every rank runs that many forwards, so that their
        all-gathers pair up; a rank with fewer splits its packs (`vlmrl.actor.micro_batches.split_to_count`)."""
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        value = torch.tensor([count], dtype=torch.long, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank (a collective: every rank calls it at the same point)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        total = values.to(self.device if self.device.type == "cuda" else "cpu").clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.cpu()

    def clip_gradients(self) -> float:
        """The GLOBAL gradient norm over every rank's shards (a collective), clipped to config.grad_clip."""
        return clip_grad_norm(self.trainable, self.config.grad_clip)

    # ---- update -----------------------------------------------------------------------------------------------------

    def update_shard(self, shard: UpdateShard, old_from_engine: bool = False) -> dict[str, float]:
        """ppo_epochs x mini-batches optimizer steps over this rank's shard (all ranks step together), then one
        lr-scheduler step: this rank's half of `DistributedActor.update`. Returns this rank's metric parts (the
        single-process actor's keys); the driver averages them over ranks (each part is already scaled so that the
        average is the global mini-batch value)."""
        batch = shard.batch
        if len(batch) != len(shard.mini_batch_tokens) * shard.local_mini_batch:
            raise ValueError(f"shard of {len(batch)} rows is not {len(shard.mini_batch_tokens)} mini-batches of "
                             f"{shard.local_mini_batch} rows")
        # summed loss / (global normaliser / world): FSDP's gradient average then gives the global aggregate; a
        # mini-batch with no token on any rank has 0 tokens and is skipped on every rank, so no collective is missed
        normalisers = [torch.tensor(value / self.world_size, dtype=torch.float64)
                       for value in shard.mini_batch_normalisers]
        tokens = [torch.tensor(value / self.world_size, dtype=torch.float64) for value in shard.mini_batch_tokens]
        return self.ppo_update(batch, shard.old_logprobs, shard.advantages, shard.ref_logprobs, shard.local_mini_batch,
                               normalisers, tokens, keep_empty_micro_batches=True, loss_weights=shard.loss_weights,
                               old_from_engine=old_from_engine)

    # ---- weights and state ------------------------------------------------------------------------------------------

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, one at a time. A collective: every rank must consume it all."""
        return iter_full_state_dict(self.model, prefix_to_strip=WRAPPED_PREFIX)

    def weight_names(self) -> list[str]:
        """The names `named_tensors` gives, in its order, without gathering anything."""
        return [name[len(WRAPPED_PREFIX):] if name.startswith(WRAPPED_PREFIX) else name
                for name in self.model.state_dict()]

    def optimizer_state(self) -> dict:
        """Optimizer (full, gathered: independent of the number of ranks, so a run can resume on another dp size)
        and scheduler state. A collective; the optimizer part is complete on rank 0 only (empty elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
                "scheduler": self.scheduler.state_dict()}

    def load_optimizer_state(self, state: dict) -> None:
        """Load `optimizer_state()`'s result (given to rank 0; other ranks may pass an empty optimizer part):
        rank 0 broadcasts it and every rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
