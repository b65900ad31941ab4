"""One rank's share of the actor: the policy (and frozen reference) sharded with FSDP2, logprobs and the GRPO update.

Runs inside a training worker (`vlmrl.distributed.worker`); with world_size 1 nothing is sharded and it is a plain
single-device actor. The logprob pass and the update loop are the single-process trainer's
(`vlmrl.trainer.actor.BaseActor`: one loop for both); what differs with several ranks is what this class feeds it:

- LOSS NORMALISATION. A mini-batch's loss is the token mean over the whole GLOBAL mini-batch. FSDP averages the
  ranks' gradients, so each rank divides its summed token loss by (global token count / world_size): the average of
  the ranks' gradients is then exactly the single-process gradient, whatever the token counts per rank. (Averaging
  each rank's own token mean instead was measured off by 0.1 in gradient.)
- NO LOCAL SKIPS. A micro-batch without policy tokens on this rank (padding rows) still runs forward and backward:
  the other ranks' collectives wait for it. Only a mini-batch with no token on ANY rank is skipped, on every rank.
- EVERY FORWARD RUNS THE VISION TOWER (`VisionAlwaysOn`), image or not.
- The gradient norm (`clip_gradients`) and the full weights are collectives over the shards.
- No autocast: the weights' dtype is the compute dtype.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vlmrl.config import ActorConfig
from vlmrl.distributed.fsdp import clip_grad_norm, iter_full_state_dict, shard_model
from vlmrl.distributed.vision import WRAPPED_PREFIX, VisionAlwaysOn
from vlmrl.trainer.actor import BaseActor, load_policy, resolve_device
from vlmrl.types import TrainBatch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA, float32 on CPU. float64 is accepted here for exactness tests."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


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
    """(b,) sequence advantages (computed by the driver over whole groups; 0 on padding rows)."""
    ref_logprobs: torch.Tensor | None
    """(b, R) reference logprobs when the KL loss is on."""
    mini_batch_tokens: list[float]
    """Policy-token count of each GLOBAL mini-batch (all ranks); the loss divides by it."""
    local_mini_batch: int
    """Rows of this shard per mini-batch."""


class ShardedActor(BaseActor):
    """The policy (and reference) on this rank. Construct on every rank with the same arguments, after the
    process group is up (`vlmrl.distributed.fsdp.init_process_group`)."""

    def __init__(self, config: ActorConfig, world_size: int, temperature: float = 1.0, init_path: str | None = None,
                 lr_lambda=None):
        """
        Args:
            config: actor settings (model, optimizer, clip ratios, KL, micro-batch size...).
            world_size: ranks in the group (1 = no sharding).
            temperature: logprobs are of softmax(logits / temperature), the distribution the policy sampled.
            init_path: weights to start from instead of config.model_path (a checkpoint); the reference is always
                config.model_path.
            lr_lambda: step -> lr factor for LambdaLR (the trainer's schedule); None = constant.
        """
        self.config = config
        self.world_size = world_size
        self.temperature = temperature
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.compute_dtype = resolve_dtype(config.compute_dtype, self.device)  # autocast as the single-device actor
        policy = load_policy(init_path or config.model_path, self.dtype, self.device)
        policy.config.use_cache = False
        if config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if config.freeze_vision_tower:
            policy.model.visual.requires_grad_(False)
        self.reference: torch.nn.Module | None = None
        if config.use_kl_loss:
            ref = policy if init_path is None else load_policy(config.model_path, self.dtype, self.device)
            ref = copy.deepcopy(ref).eval().requires_grad_(False)
            self.reference = shard_model(VisionAlwaysOn(ref), world_size)
        # sharding replaces the parameters by DTensors: the optimizer is built on the sharded ones
        self.model = shard_model(VisionAlwaysOn(policy), world_size)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.optim.lr, betas=tuple(config.optim.betas),
                                           weight_decay=config.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or (lambda step: 1.0))

    def clip_gradients(self) -> float:
        """The GLOBAL gradient norm over every rank's shards (a collective), clipped to config.grad_clip."""
        return clip_grad_norm(self.trainable, self.config.grad_clip)

    # ---- update -----------------------------------------------------------------------------------------------------

    def update(self, shard: UpdateShard) -> dict[str, float]:
        """ppo_epochs x mini-batches optimizer steps over this rank's shard (all ranks step together), then one
        lr-scheduler step. Returns this rank's metric parts (the single-process actor's keys); the driver averages
        them over ranks (each part is already scaled so that the average is the global mini-batch value)."""
        batch = shard.batch
        if len(batch) != len(shard.mini_batch_tokens) * shard.local_mini_batch:
            raise ValueError(f"shard of {len(batch)} rows is not {len(shard.mini_batch_tokens)} mini-batches of "
                             f"{shard.local_mini_batch} rows")
        # summed token loss / (global tokens / world): FSDP's gradient average then gives the global mean; a
        # mini-batch with no token on any rank has normaliser 0 and is skipped on every rank, so no collective is missed
        normalisers = [torch.tensor(tokens / self.world_size, dtype=torch.float32)
                       for tokens in shard.mini_batch_tokens]
        return self.ppo_update(batch, shard.old_logprobs, shard.advantages, shard.ref_logprobs, shard.local_mini_batch,
                               normalisers, keep_empty_micro_batches=True)

    # ---- weights and state ------------------------------------------------------------------------------------------

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, one at a time. A collective: every rank must consume it all."""
        return iter_full_state_dict(self.model, prefix_to_strip=WRAPPED_PREFIX)

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
