"""One rank's share of the actor: the policy (and frozen reference) sharded with FSDP2, logprobs and the GRPO update.

Runs inside a training worker (`vlmrl.distributed.worker`); with world_size 1 nothing is sharded and it is a plain
single-device actor. The per-micro-batch math is the single-process trainer's (`vlmrl.trainer.actor.micro_batch`,
`forward_response`, and `vlmrl.algorithms.grpo`); what differs with several ranks:

- LOSS NORMALISATION. A mini-batch's loss is the token mean over the whole GLOBAL mini-batch. FSDP averages the
  ranks' gradients, so each rank divides its summed token loss by (global token count / world_size): the average of
  the ranks' gradients is then exactly the single-process gradient, whatever the token counts per rank. (Averaging
  each rank's own token mean instead was measured off by 0.1 in gradient.)
- NO LOCAL SKIPS. A micro-batch without policy tokens on this rank (padding rows) still runs forward and backward:
  the other ranks' collectives wait for it. Only a mini-batch with no token on ANY rank is skipped, on every rank.
- EVERY FORWARD RUNS THE VISION TOWER (`VisionAlwaysOn`), image or not.
- The gradient norm and the full weights are collectives over the shards.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from vlmrl.algorithms.grpo import broadcast_to_tokens, kl_penalty, ppo_clip_loss, token_mean
from vlmrl.config import ActorConfig
from vlmrl.distributed.fsdp import clip_grad_norm, iter_full_state_dict, shard_model
from vlmrl.distributed.vision import WRAPPED_PREFIX, VisionAlwaysOn
from vlmrl.trainer.actor import forward_response, load_policy, micro_batch, resolve_device
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


def _add(parts: dict[str, float], key: str, value: torch.Tensor | float) -> None:
    parts[key] = parts.get(key, 0.0) + float(value.detach() if isinstance(value, torch.Tensor) else value)


def chunks(rows: Sequence[int], size: int) -> list[list[int]]:
    return [list(rows[i: i + size]) for i in range(0, len(rows), size)]


class ShardedActor:
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

    # ---- logprobs ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, with_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(b, R) logprobs of this rank's rows (0 off the response mask) and optionally their entropy.
        Every rank must call it with the same number of rows (the forwards are collectives)."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is loaded only when actor.use_kl_loss is true")
        was_training = model.training
        model.eval()
        width = batch.response_mask.shape[1]
        logprobs = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        entropy = torch.zeros_like(logprobs) if with_entropy else None
        for rows in chunks(range(len(batch)), self.config.ppo_micro_batch_size_per_gpu):
            lp, ent = forward_response(model, micro_batch(batch, rows, self.device), self.temperature, with_entropy)
            logprobs[rows, : lp.shape[1]] = lp.float().cpu()
            if entropy is not None:
                entropy[rows, : ent.shape[1]] = ent.float().cpu()
        model.train(was_training)
        mask = batch.response_mask
        return logprobs * mask, (entropy * mask if entropy is not None else None)

    # ---- update -----------------------------------------------------------------------------------------------------

    def update(self, shard: UpdateShard) -> dict[str, float]:
        """ppo_epochs x mini-batches optimizer steps over this rank's shard (all ranks step together), then one
        lr-scheduler step. Returns this rank's metric parts (the single-process actor's keys); the driver averages
        them over ranks (each part is already scaled so that the average is the global mini-batch value)."""
        cfg = self.config
        batch = shard.batch
        if len(batch) != len(shard.mini_batch_tokens) * shard.local_mini_batch:
            raise ValueError(f"shard of {len(batch)} rows is not {len(shard.mini_batch_tokens)} mini-batches of "
                             f"{shard.local_mini_batch} rows")
        if shard.old_logprobs is None and not (cfg.ppo_epochs == 1 and len(shard.mini_batch_tokens) == 1):
            raise ValueError("old_logprobs are needed when the batch gets more than one optimizer step")
        if cfg.use_kl_loss and shard.ref_logprobs is None:
            raise ValueError("actor.use_kl_loss is on but no reference logprobs were given")
        token_adv = broadcast_to_tokens(shard.advantages.float(), batch.response_mask)
        self.model.train()
        totals: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(cfg.ppo_epochs):
            for index, mini_rows in enumerate(chunks(range(len(batch)), shard.local_mini_batch)):
                global_tokens = shard.mini_batch_tokens[index]
                if global_tokens == 0:  # padding rows on every rank: every rank skips, so no collective is missed
                    skipped += 1
                    continue
                # summed token loss / (global tokens / world): FSDP's gradient average then gives the global mean
                num_tokens = torch.tensor(global_tokens / self.world_size, dtype=torch.float32)
                parts = self._accumulate(shard, mini_rows, num_tokens, token_adv)
                grad_norm = clip_grad_norm(self.trainable, cfg.grad_clip)
                if math.isfinite(grad_norm):  # the same global norm on every rank: all step or none
                    self.optimizer.step()
                else:
                    logger.warning("non-finite gradient norm; optimizer step skipped")
                    skipped += 1
                parts["actor/grad_norm"] = grad_norm
                for key, value in parts.items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        metrics = {key: value / steps for key, value in totals.items()} if steps else {}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/skipped_steps"] = float(skipped)
        self.scheduler.step()
        return metrics

    def _accumulate(self, shard: UpdateShard, mini_rows: list[int], num_tokens: torch.Tensor,
                    token_adv: torch.Tensor) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank's slice of one mini-batch (none skipped: a micro-batch
        without tokens here still joins the other ranks' collectives, with a zero loss)."""
        cfg, batch = self.config, shard.batch
        self.optimizer.zero_grad(set_to_none=True)
        parts = dict.fromkeys(("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"), 0.0)
        compare_rollout = batch.rollout_logprobs is not None and self.temperature == 1.0
        for rows in chunks(mini_rows, cfg.ppo_micro_batch_size_per_gpu):
            mb = micro_batch(batch, rows, self.device)
            width = mb.response_width
            mask = batch.response_mask[rows, :width].to(self.device)
            share = float(mask.sum() / num_tokens)  # weight of this micro-batch's diagnostics in the global mean
            logprobs, entropy = forward_response(self.model, mb, self.temperature, True, bool(cfg.entropy_coeff))
            old = (logprobs.detach() if shard.old_logprobs is None
                   else shard.old_logprobs[rows, :width].to(self.device))
            pg = ppo_clip_loss(logprobs, old, token_adv[rows, :width].to(self.device), mask, cfg.clip_ratio,
                               cfg.clip_ratio_high or cfg.clip_ratio, num_tokens=num_tokens)
            loss = pg.loss
            entropy_mean = token_mean(entropy, mask, num_tokens)
            _add(parts, "actor/entropy", entropy_mean)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_mean
                _add(parts, "actor/entropy_loss", entropy_mean)
            if cfg.use_kl_loss:
                ref = shard.ref_logprobs[rows, :width].to(self.device)
                kl_loss = token_mean(kl_penalty(logprobs, ref, cfg.kl_loss_type), mask, num_tokens)
                loss = loss + cfg.kl_loss_coef * kl_loss
                _add(parts, "actor/kl_loss", kl_loss)
            loss.backward()
            _add(parts, "actor/pg_loss", pg.loss)
            _add(parts, "actor/pg_clipfrac", pg.clip_fraction * share)
            _add(parts, "actor/ppo_kl", pg.approx_kl * share)
            if compare_rollout:  # engine vs trainer: how off-policy the samples really are
                gap = (old - batch.rollout_logprobs[rows, :width].to(self.device)).abs()
                _add(parts, "rollout/logprob_abs_diff", token_mean(gap, mask, num_tokens))
        return parts

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
