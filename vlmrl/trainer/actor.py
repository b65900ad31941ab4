"""The actor: a HF Qwen2.5-VL policy, its logprobs, and the GRPO update over mini- and micro-batches.

Every forward gets EXPLICIT 3D position ids (`TrainBatch.mrope_position_ids()`, computed by the processor): without
them transformers silently falls back to 1-D positions and logprobs drift by up to a nat (notes: cpu-engines.md).

A micro-batch's loss is its summed token loss divided by the token count of the whole MINI-batch, so accumulating
micro-batch gradients gives exactly the mini-batch's token-mean gradient: 1 micro-batch of 8 == 8 micro-batches of 1.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from vlmrl.algorithms.grpo import (
    broadcast_to_tokens,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_clip_loss,
    token_mean,
)
from vlmrl.config import ActorConfig
from vlmrl.types import TrainBatch

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_policy(model_path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Load a Qwen2-VL / Qwen2.5-VL checkpoint (HF format) for training."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models import resolve_model_path

    model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(model_path), dtype=dtype)
    return model.to(device)


@dataclass
class MicroBatch:
    """Model inputs for some rows of a TrainBatch, with all-padding columns trimmed (positions are explicit, so
    dropping columns that no row attends changes nothing but the cost)."""

    rows: list[int]
    input_ids: torch.Tensor
    """(b, l) long."""
    attention_mask: torch.Tensor
    """(b, l) long."""
    position_ids: torch.Tensor
    """(3, b, l) long: the layout the HF forward takes."""
    response_width: int
    """r: the last r columns are the (trimmed) response."""
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


def micro_batch(batch: TrainBatch, rows: Sequence[int], device: torch.device) -> MicroBatch:
    index = torch.as_tensor(list(rows), dtype=torch.long)
    attention = batch.attention_mask[index]
    prompt_len = batch.prompt_length
    attended_prompt = attention[:, :prompt_len].any(dim=0).nonzero()
    start = int(attended_prompt[0]) if len(attended_prompt) else prompt_len - 1
    attended_response = attention[:, prompt_len:].any(dim=0).nonzero()
    width = int(attended_response[-1]) + 1 if len(attended_response) else 1
    columns = slice(start, prompt_len + width)
    mm = [batch.multi_modal_inputs[i] for i in rows if batch.multi_modal_inputs[i]]
    pixel_values = torch.cat([m["pixel_values"] for m in mm]).to(device) if mm else None
    grid = torch.cat([m["image_grid_thw"] for m in mm]).to(device) if mm else None
    return MicroBatch(
        rows=list(rows),
        input_ids=batch.input_ids[index, columns].to(device),
        attention_mask=attention[:, columns].to(device),
        position_ids=batch.position_ids[index][:, :, columns].permute(1, 0, 2).contiguous().to(device),
        response_width=width,
        pixel_values=pixel_values,
        image_grid_thw=grid,
    )


def forward_response(model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (b, r) of the response tokens under softmax(logits / temperature), and their entropy (b, r)
    (without a graph unless `entropy_grad`: a metric needs no backward)."""
    pixel_values = mb.pixel_values.to(next(model.parameters()).dtype) if mb.pixel_values is not None else None
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        pixel_values=pixel_values,
        image_grid_thw=mb.image_grid_thw,
        use_cache=False,
        logits_to_keep=mb.response_width + 1,  # positions P-1 .. L-2 predict the response tokens P .. L-1
    )
    logits = out.logits[:, :-1].float() / temperature  # (b, r, V)
    labels = mb.input_ids[:, -mb.response_width :]
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, r) -> (b, width), zero-filled on the right (trimmed response columns back to the batch's R)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def _chunks(rows: Sequence[int], size: int) -> list[list[int]]:
    return [list(rows[i : i + size]) for i in range(0, len(rows), size)]


class BaseActor:
    """What the single-process actor and one FSDP rank's actor (`vlmrl.distributed.actor.ShardedActor`) share: the
    logprob pass and the PPO update loop. ONE loop serves both, so their math cannot drift apart.

    A subclass builds `config`, `device`, `dtype`, `compute_dtype`, `temperature`, `model`, `reference` (or None),
    `trainable`, `optimizer` and `scheduler`, and may override `clip_gradients` (a sharded model needs the norm over
    every rank's shards).
    """

    config: ActorConfig
    device: torch.device
    dtype: torch.dtype
    compute_dtype: torch.dtype
    temperature: float
    model: torch.nn.Module
    reference: torch.nn.Module | None
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def autocast(self):
        """Mixed precision for a forward (and its backward) when compute and weight dtypes differ."""
        lower = self.compute_dtype in (torch.bfloat16, torch.float16)  # autocast only casts down
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=lower and self.compute_dtype != self.dtype)

    def clip_gradients(self) -> float:
        """Clip the gradient norm to config.grad_clip (<= 0: measure only); returns the norm before clipping."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))

    # ---- logprobs ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, with_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) logprobs of the response tokens (0 on padding) and, optionally, their (B, R) entropy.
        `reference=True` uses the frozen reference (only when the KL loss is on). On a sharded model every rank must
        call it with the same number of rows (the forwards are collectives)."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is loaded only when actor.use_kl_loss is true")
        was_training = model.training
        model.eval()
        width = batch.response_mask.shape[1]
        logprobs = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        entropy = torch.zeros_like(logprobs) if with_entropy else None
        for rows in _chunks(range(len(batch)), self.config.ppo_micro_batch_size_per_gpu):
            with self.autocast():
                lp, ent = forward_response(model, micro_batch(batch, rows, self.device), self.temperature, with_entropy)
            logprobs[rows] = _pad_to(lp.cpu(), width)
            if entropy is not None:
                entropy[rows] = _pad_to(ent.cpu(), width)
        model.train(was_training)
        return logprobs * batch.response_mask, (entropy * batch.response_mask if entropy is not None else None)

    # ---- update -----------------------------------------------------------------------------------------------------

    def ppo_update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                   ref_logprobs: torch.Tensor | None, mini_batch_rows: int, normalisers: Sequence[torch.Tensor],
                   keep_empty_micro_batches: bool) -> dict[str, float]:
        """PPO-clip updates: ppo_epochs x len(normalisers) optimizer steps, each accumulating micro-batch gradients;
        then one lr-scheduler step (one per training step).

        Args:
            batch: B = len(normalisers) * mini_batch_rows rows; row block m is mini-batch m.
            old_logprobs: (B, R), or None when there is exactly one optimizer step (ratio 1, see `update`).
            advantages: (B,) sequence advantages (0 on padding rows).
            ref_logprobs: (B, R) reference logprobs; required when the KL loss is on.
            mini_batch_rows: rows per mini-batch.
            normalisers: per mini-batch, the scalar its summed token loss is divided by: its token count (single
                process), or the GLOBAL mini-batch's token count / world size (one FSDP rank: the ranks' gradient
                average is then the global token mean). 0 = no token anywhere: the step is skipped (on every rank).
            keep_empty_micro_batches: run micro-batches without a token too (zero loss): an FSDP rank must join
                every collective the other ranks issue.

        Returns:
            metrics averaged over optimizer steps (see `Actor.update`).
        """
        cfg = self.config
        if old_logprobs is None and not (cfg.ppo_epochs == 1 and len(normalisers) == 1):
            raise ValueError("old_logprobs are needed when the batch gets more than one optimizer step")
        if cfg.use_kl_loss and ref_logprobs is None:
            raise ValueError("actor.use_kl_loss is on but no reference logprobs were given")
        token_adv = broadcast_to_tokens(advantages.float(), batch.response_mask)
        self.model.train()
        totals: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(cfg.ppo_epochs):
            for num_tokens, mini_rows in zip(normalisers, _chunks(range(len(batch)), mini_batch_rows), strict=True):
                if num_tokens == 0:  # only padding rows: nothing to learn, and no metric either
                    skipped += 1
                    continue
                parts = self._accumulate(batch, mini_rows, num_tokens, old_logprobs, token_adv, ref_logprobs,
                                         keep_empty_micro_batches)
                grad_norm = self.clip_gradients()
                if math.isfinite(grad_norm):  # sharded: the same global norm on every rank, so all step or none
                    self.optimizer.step()
                else:  # a NaN/inf gradient would poison the weights: skip the step, say so in the metrics
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

    def _accumulate(self, batch: TrainBatch, mini_rows: list[int], num_tokens: torch.Tensor,
                    old_logprobs: torch.Tensor | None, token_adv: torch.Tensor, ref_logprobs: torch.Tensor | None,
                    keep_empty_micro_batches: bool) -> dict[str, float]:
        """Forward/backward every micro-batch of one mini-batch; returns the mini-batch's loss parts (each scaled by
        `num_tokens`, so on FSDP ranks the average over ranks is the global mini-batch value)."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        parts = dict.fromkeys(("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"), 0.0)
        if cfg.entropy_coeff:
            parts["actor/entropy_loss"] = 0.0
        if cfg.use_kl_loss:
            parts["actor/kl_loss"] = 0.0
        compare_rollout = batch.rollout_logprobs is not None and self.temperature == 1.0
        if compare_rollout:
            parts["rollout/logprob_abs_diff"] = 0.0
        for rows in _chunks(mini_rows, cfg.ppo_micro_batch_size_per_gpu):
            mb = micro_batch(batch, rows, self.device)
            width = mb.response_width
            mask = batch.response_mask[rows, :width].to(self.device)
            share = float(mask.sum() / num_tokens)  # this micro-batch's weight in the mini-batch token mean
            if share == 0 and not keep_empty_micro_batches:
                continue
            with self.autocast():
                logprobs, entropy = forward_response(self.model, mb, self.temperature, True, bool(cfg.entropy_coeff))
            old = logprobs.detach() if old_logprobs is None else old_logprobs[rows, :width].to(self.device)
            adv = token_adv[rows, :width].to(self.device)
            pg = ppo_clip_loss(logprobs, old, adv, mask, cfg.clip_ratio, cfg.clip_ratio_high or cfg.clip_ratio,
                               num_tokens=num_tokens)
            loss = pg.loss
            entropy_mean = token_mean(entropy, mask, num_tokens)
            parts["actor/entropy"] += float(entropy_mean.detach())
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_mean
                parts["actor/entropy_loss"] += float(entropy_mean.detach())
            if cfg.use_kl_loss:
                ref = ref_logprobs[rows, :width].to(self.device)
                kl_loss = token_mean(kl_penalty(logprobs, ref, cfg.kl_loss_type), mask, num_tokens)
                loss = loss + cfg.kl_loss_coef * kl_loss
                parts["actor/kl_loss"] += float(kl_loss.detach())
            loss.backward()
            parts["actor/pg_loss"] += float(pg.loss.detach())
            parts["actor/pg_clipfrac"] += float(pg.clip_fraction) * share
            parts["actor/ppo_kl"] += float(pg.approx_kl) * share
            if compare_rollout:  # engine vs trainer: how off-policy the samples really are
                gap = (old - batch.rollout_logprobs[rows, :width].to(self.device)).abs()
                parts["rollout/logprob_abs_diff"] += float(token_mean(gap, mask, num_tokens))
        return parts


class Actor(BaseActor):
    """The policy being trained, its optimizer, and (when KL is on) a frozen reference copy of the initial weights.

    Single process, single device. `named_tensors()` feeds the rollout backend's weight sync.
    """

    def __init__(self, config: ActorConfig, total_steps: int, mini_batch_samples: int, temperature: float = 1.0,
                 init_path: str | None = None):
        """
        Args:
            config: actor settings.
            total_steps: training steps (for the lr schedule).
            mini_batch_samples: rows per optimizer step (ppo_mini_batch_size * rollout.n).
            temperature: the sampling temperature; logprobs are of softmax(logits / temperature), the policy sampled.
            init_path: load weights from here instead of config.model_path (a checkpoint to resume from); the
                reference always comes from config.model_path.
        """
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Master weights stay in self.dtype; the forward runs under autocast when the compute dtype differs.
        self.compute_dtype = resolve_dtype(config.compute_dtype, self.device)
        self.temperature = temperature
        self.mini_batch_samples = mini_batch_samples
        self.model = load_policy(init_path or config.model_path, self.dtype, self.device)
        self.model.config.use_cache = False
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if config.freeze_vision_tower:
            for param in self.model.model.visual.parameters():
                param.requires_grad_(False)
        self.reference: torch.nn.Module | None = None
        if config.use_kl_loss:
            ref = self.model if init_path is None else load_policy(config.model_path, self.dtype, self.device)
            self.reference = copy.deepcopy(ref).eval().requires_grad_(False)
            logger.info("frozen reference loaded from %s (KL %s, coef %g)", config.model_path, config.kl_loss_type,
                        config.kl_loss_coef)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.optim.lr, betas=tuple(config.optim.betas),
                                           weight_decay=config.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config, total_steps))
        logger.info("actor %s: %.2fM trainable parameters, %s weights, %s compute on %s", config.model_path,
                    sum(p.numel() for p in self.trainable) / 1e6, self.dtype, self.compute_dtype, self.device)

    # ---- update -----------------------------------------------------------------------------------------------------

    def skips_old_logprobs(self, batch_rows: int) -> bool:
        """True when the batch gets exactly one optimizer step: the policy that generated it is then the one being
        updated, so the old logprobs equal the update forward's own (detached) and need no extra pass."""
        return self.config.ppo_epochs == 1 and batch_rows == self.mini_batch_samples

    def update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """PPO-clip updates over the batch: ppo_epochs x (len(batch) / mini_batch_samples) optimizer steps, each
        accumulating micro-batch gradients; then one lr-scheduler step (one per training step).

        Args:
            batch: B rows, B a multiple of mini_batch_samples (upsampled with padding rows).
            old_logprobs: (B, R) logprobs of the policy that generated the batch; None only when
                `skips_old_logprobs(B)` (then they are the update forward's own, detached: ratio 1).
            advantages: (B,) sequence advantages (0 on padding rows).
            ref_logprobs: (B, R) reference logprobs; required when the KL loss is on.

        Returns:
            metrics averaged over optimizer steps: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, actor/entropy,
            actor/kl_loss, actor/entropy_loss, actor/grad_norm, actor/lr, actor/skipped_steps, and
            rollout/logprob_abs_diff (|old - backend| logprobs, at temperature 1 only).
        """
        if len(batch) % self.mini_batch_samples:
            raise ValueError(f"batch of {len(batch)} rows is not a multiple of the mini-batch "
                             f"({self.mini_batch_samples}); upsample it with padding rows first")
        normalisers = [batch.response_mask[rows].sum() for rows in _chunks(range(len(batch)), self.mini_batch_samples)]
        return self.ppo_update(batch, old_logprobs, advantages, ref_logprobs, self.mini_batch_samples, normalisers,
                               keep_empty_micro_batches=False)

    def supervised_step(self, batch: TrainBatch, optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step of token-mean negative log-likelihood of the response tokens (the format warm-up).
        Uses the given optimizer (the warm-up's own), never the RL optimizer or its schedule. Returns the loss."""
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        num_tokens = batch.response_mask.sum()
        total = 0.0
        for rows in _chunks(range(len(batch)), self.config.ppo_micro_batch_size_per_gpu):
            mb = micro_batch(batch, rows, self.device)
            mask = batch.response_mask[rows, : mb.response_width].to(self.device)
            with self.autocast():
                logprobs, _ = forward_response(self.model, mb, 1.0, with_entropy=False)
            loss = -token_mean(logprobs, mask, num_tokens)
            loss.backward()
            total += float(loss.detach())
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    # ---- weights and state ------------------------------------------------------------------------------------------

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight, as `model.state_dict()` names them (what the backends' sync takes)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the weights are saved in HF format beside it)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _lr_lambda(config: ActorConfig, total_steps: int):
    warmup, kind = config.optim.lr_warmup_steps, config.optim.lr_scheduler

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor
