"""The single-process actor: the policy on one device, its optimizer, and (when KL is on) a frozen reference copy of
the initial weights, or with LoRA the base model under the adapters. It implements `vlmrl.actor.base.PolicyActor` for the
fit loop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from vlmrl.actor.config import ActorConfig
from vlmrl.actor.core import ActorCore, mini_batch_scales, needs_old_logprobs
from vlmrl.actor.forward import forward_response, micro_batch
from vlmrl.actor.lora import ADAPTER_DIR, LoraSync, merged_tensors, peft_model_of, write_adapter
from vlmrl.actor.policy import build_policy
from vlmrl.algorithms.config import DistillConfig
from vlmrl.algorithms.grpo import token_mean
from vlmrl.rollout.base import RolloutBackend
from vlmrl.types import TrainBatch


class Actor(ActorCore):
    """The policy being trained on one device. `sync_weights` loads its weights into the rollout backend."""

    dp_size = 1

    def __init__(self, config: ActorConfig, total_steps: int, mini_batch_samples: int, temperature: float = 1.0,
                 init_path: str | None = None, distill: DistillConfig | None = None):
        """
        Args:
            config: actor settings.
            total_steps: training steps (for the lr schedule).
            mini_batch_samples: rows per optimizer step (ppo_mini_batch_size * rollout.n).
            temperature: the sampling temperature; logprobs are of softmax(logits / temperature), the policy sampled.
            init_path: load weights from here instead of config.model_path (a checkpoint to resume from); the
                reference always comes from config.model_path.
            distill: on-policy distillation (algorithm.distill): with a teacher, it is loaded frozen beside the
                policy, and `compute_logprobs(teacher=True)` scores with it.
        """
        super().__init__(config, build_policy(config, total_steps, init_path, distill=distill), temperature)
        self.mini_batch_samples = mini_batch_samples
        self.lora_sync = LoraSync(config.lora, self.model) if self.peft_config is not None else None
        self.last_sync_bytes = 0
        """What the last sync_weights sent: merged tensors or the adapter file (LoRA), else the full weights."""

    # ---- update -----------------------------------------------------------------------------------------------------

    def needs_old_logprobs(self, batch_rows: int) -> bool:
        """False when the batch gets exactly one optimizer step: the old logprobs are then the update forward's own
        (detached) and need no extra pass."""
        return needs_old_logprobs(self.config, batch_rows, self.mini_batch_samples)

    def update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
               old_from_engine: bool = False) -> dict[str, float]:
        """Policy-loss updates over the batch: ppo_epochs x (len(batch) / mini_batch_samples) optimizer steps, each
        accumulating micro-batch gradients; then one lr-scheduler step (one per training step).

        Args:
            batch: B rows, B a multiple of mini_batch_samples (upsampled with padding rows); its response_mask is
                the loss mask.
            old_logprobs: (B, R) logprobs of the policy that generated the batch; None only when
                `needs_old_logprobs(B)` is false (then they are the update forward's own, detached: ratio 1).
            advantages: (B,) sequence advantages, or (B, R) per-token ones (distillation); 0 on padding rows.
            ref_logprobs: (B, R) reference logprobs; required when the KL loss is on.
            loss_weights: (B, R) rollout-correction weights multiplying the loss matrix; None = 1.
            old_from_engine: old_logprobs are the engine's (the bypass correction): rollout/logprob_abs_diff and
                mismatch/* then compare the engine with the update's own forward (the pre-update weights in the
                first mini-batch, the update so far in later ones), not with old_logprobs.

        Returns:
            metrics averaged over optimizer steps: actor/pg_loss, actor/pg_clipfrac (= _low + _high: tokens clipped
            at the lower / upper bound), actor/dual_clip_fraction, actor/ratio_mean, actor/ratio_min / _max (the
            extremes), actor/ppo_kl, actor/entropy, actor/kl_loss, actor/entropy_loss, actor/grad_norm, actor/lr,
            actor/skipped_steps (optimizer steps not taken: empty or non-finite gradient), actor/empty_steps (of
            those, mini-batches without a policy token: padding rows only, or every token masked),
            actor/empty_micro_batches (micro-batches without a policy token, skipped), distill/loss (the batch's
            teacher_logprobs set: algorithm.distill.mode=loss), and
            rollout/logprob_abs_diff (|old - backend| logprobs, at temperature 1 only).
        """
        if len(batch) % self.mini_batch_samples:
            raise ValueError(f"batch of {len(batch)} rows is not a multiple of the mini-batch "
                             f"({self.mini_batch_samples}); upsample it with padding rows first")
        normalisers, tokens = mini_batch_scales(batch.response_mask, self.mini_batch_samples, self.config.loss_agg_mode)
        return self.ppo_update(batch, old_logprobs, advantages, ref_logprobs, self.mini_batch_samples, normalisers,
                               tokens, keep_empty_micro_batches=False, loss_weights=loss_weights,
                               old_from_engine=old_from_engine)

    def supervised_step(self, batch: TrainBatch, optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step of token-mean negative log-likelihood of the response tokens (the format warm-up).
        Uses the given optimizer (the warm-up's own), never the RL optimizer or its schedule. Returns the loss."""
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        num_tokens = batch.response_mask.sum()
        total = 0.0
        for rows in self.micro_batches(batch, range(len(batch))):
            mb = micro_batch(batch, rows, self.device, self.config.padding_free)
            mask = batch.response_mask[rows, : mb.response_width].to(self.device)
            with self.autocast():
                logprobs, _ = forward_response(self.model, mb, 1.0, with_entropy=False,
                                               chunk=self.config.logprob_chunk_size)
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
        """(name, tensor) of every weight, as the HF model's `state_dict()` names them (what the backends' sync
        takes); with LoRA the merged weights (base + scaled adapter deltas)."""
        named = ((name, tensor.detach()) for name, tensor in self.model.state_dict().items())
        if self.lora_sync is not None:
            yield from merged_tensors(named, self.lora_sync.scaling)
        else:
            yield from named

    def sync_weights(self, backend: RolloutBackend) -> None:
        """The current weights into the backend's engine (LoRA: merged or as the adapter, `LoraSync`)."""
        if self.lora_sync is not None:
            self.last_sync_bytes = self.lora_sync.push(backend, self.model.state_dict().items())
            return
        state = list(self.named_tensors())
        backend.update_weights(state)
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in state)

    def full_model(self) -> torch.nn.Module:
        """The live policy (for `save_pretrained`); with LoRA a plain HF model holding the merged weights."""
        if self.lora_sync is None:
            return self.model
        from transformers import AutoModelForImageTextToText

        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(peft_model_of(self.model).base_model.model.config)
        model.load_state_dict(dict(self.named_tensors()), strict=True, assign=True)
        model.tie_weights()
        return model.eval()

    def save_adapter(self, folder: Path) -> None:
        """With LoRA: the PEFT adapter (weights + config) into `folder`/adapter, what resume reads back and vLLM or
        `PeftModel.from_pretrained` load. Nothing without LoRA."""
        if self.lora_sync is not None:
            write_adapter(Path(folder) / ADAPTER_DIR, self.model.state_dict().items(), self.peft_config)

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the weights are saved in HF format beside it)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
