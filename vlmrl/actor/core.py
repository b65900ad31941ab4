"""The actor's math, shared by the single-process actor and every rank of the sharded one: micro-batches, the
logprob pass and the PPO update loop. ONE loop serves both, so their updates cannot drift apart.

One micro-batch's inputs and its forward are `vlmrl.actor.forward`'s (explicit 3D position ids on every forward).

The loss is `actor.policy_loss`'s (B, R) loss matrix, times the rollout-correction weights when there are any,
aggregated by `actor.loss_agg_mode`. Every mode is a sum of per-row terms divided by ONE normaliser of the whole
MINI-batch (`vlmrl.algorithms.aggregation.loss_normaliser`), which every micro-batch divides by: accumulating micro-batch
gradients then gives exactly the mini-batch's gradient, 1 micro-batch of 8 == 8 micro-batches of 1.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from functools import partial

import torch

from vlmrl.actor.config import ActorConfig
from vlmrl.actor.forward import MicroBatch, forward_response, forward_top_logprobs, micro_batch
from vlmrl.actor.micro_batches import micro_batch_rows, row_spans, split_to_count
from vlmrl.actor.policy import Policy, move_optimizer_state
from vlmrl.actor.router_hooks import RouterHooks, collect_aux
from vlmrl.actor.step_metrics import mean_metrics
from vlmrl.actor.vision_share import VisionCounts, shared_vision
from vlmrl.algorithms.aggregation import agg_loss, loss_normaliser, token_mean
from vlmrl.algorithms.distill import forward_kl_topk_loss, reverse_kl_loss, topk_mass
from vlmrl.algorithms.grpo import broadcast_to_tokens, kl_penalty
from vlmrl.algorithms.mismatch import MismatchAccumulator, modality
from vlmrl.algorithms.policy_loss import POLICY_LOSS_FNS
from vlmrl.models.families import family_of
from vlmrl.models.flops import model_flops
from vlmrl.types import TrainBatch
from vlmrl.utils.sequences import chunks

logger = logging.getLogger(__name__)


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, r) -> (b, width), zero-filled on the right (trimmed response columns back to the batch's R)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def needs_old_logprobs(config: ActorConfig, batch_rows: int, mini_batch_rows: int) -> bool:
    """False when a batch gets exactly one optimizer step (one epoch of one mini-batch): the policy that generated it
    is then the one being updated, so the old logprobs equal the update forward's own (detached) and need no pass."""
    return not (config.ppo_epochs == 1 and batch_rows == mini_batch_rows)


def mini_batch_scales(response_mask: torch.Tensor, mini_batch_rows: int, mode: str
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per mini-batch (row blocks of `mini_batch_rows`): the loss normaliser of `mode` and the token count of the
    WHOLE mini-batch (a sharded rank divides both by the world size: the ranks' averaged gradient is then the
    single-process one). The token counts weigh the token-mean metrics (clip fractions, ratios, KL).

    The response width R is data.max_response_length (every batch is padded to it), seq-mean-token-sum-norm's
    constant."""
    normalisers, tokens = [], []
    for rows in chunks(range(response_mask.shape[0]), mini_batch_rows):
        mask = response_mask[rows]
        normalisers.append(loss_normaliser(mask, mode))
        tokens.append((mask != 0).sum().to(torch.float64))
    return normalisers, tokens


class ActorCore:
    """What the single-process actor (`vlmrl.actor.local.Actor`) and one FSDP rank's actor
    (`vlmrl.distributed.actor.ShardedActor`) share: a policy built by `vlmrl.actor.policy.build_policy`, the logprob
    pass and the PPO update loop. A subclass feeds `ppo_update` its mini-batches and loss normalisers, and may
    override `clip_gradients` (a sharded model needs the norm over every rank's shards).
    """

    def __init__(self, config: ActorConfig, policy: Policy, temperature: float):
        """
        Args:
            config: actor settings (the ones `policy` was built from).
            policy: the built model, reference, optimizer and schedule.
            temperature: the sampling temperature; logprobs are of softmax(logits / temperature), the policy sampled.
        """
        self.config = config
        self.temperature = temperature
        self.device = policy.device
        self.dtype = policy.dtype
        # master weights stay in self.dtype; the forward runs under autocast when the compute dtype is lower
        self.compute_dtype = policy.compute_dtype
        self.model = policy.model
        self.reference = policy.reference
        self.trainable = policy.trainable
        self.optimizer = policy.optimizer
        self.scheduler = policy.scheduler
        self.peft_config = policy.peft_config
        """The PEFT LoraConfig with actor.lora on (the model is a PeftModel), else None."""
        self.reference_on_host = policy.reference_on_host
        self.teacher, self.distill = policy.teacher, policy.distill  # on-policy distillation (algorithm.distill)
        self.teacher_on_host = policy.teacher_on_host
        # actor.offload.optimizer: AdamW's state waits in host memory between steps (with offloaded parameters it
        # lives there anyway: the optimizer steps on the CPU)
        self.offload_optimizer = config.offload.optimizer and not config.offload.params
        experts = family_of(self.model.config).experts
        self.routing = RouterHooks(self.model, experts.router_class) if experts is not None else None
        """A MoE policy's router hooks: the old-logprob pass records each row's routing, the update replays it
        (actor.moe.routing_replay=trainer) or counts where its own differs (mismatch/routing_*)."""
        flops = model_flops(self.model.config)
        trains = not config.freeze_vision_tower and not (config.lora.enabled and config.lora.vision == "off")
        self.vision_counts = VisionCounts(
            flops=partial(flops.vision_flops, trains=trains) if flops is not None and flops.vision_params else None)
        """The images and videos the update's forwards carried and encoded (actor.share_vision), and their FLOPs."""

    def set_temperature(self, temperature: float) -> None:
        """Logprobs from here on are of softmax(logits / temperature)."""
        self.temperature = temperature

    def forward_dtype(self) -> torch.dtype:
        """What the forward computes in: the lower of the weights' dtype and the autocast compute dtype."""
        return self.compute_dtype if self.compute_dtype in (torch.bfloat16, torch.float16) else self.dtype

    def forward_context(self, model: torch.nn.Module, counts: VisionCounts | None = None):
        """What a forward of `model` runs in: mixed precision (`autocast`) and, with actor.share_vision, the vision
        tower once per distinct image (`vlmrl.actor.vision_share`); `counts` adds up its images."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        stack.enter_context(shared_vision(model, counts, enabled=self.config.share_vision))
        return stack

    def autocast(self):
        """Mixed precision for a forward (and its backward) when compute and weight dtypes differ."""
        lower = self.compute_dtype in (torch.bfloat16, torch.float16)  # autocast only casts down
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=lower and self.compute_dtype != self.dtype)

    def optimizer_step(self) -> None:
        """One optimizer step; with actor.offload.optimizer its state comes from host memory and goes back."""
        if not self.offload_optimizer:
            self.optimizer.step()
            return
        move_optimizer_state(self.optimizer, self.device)
        self.optimizer.step()
        move_optimizer_state(self.optimizer, "cpu")

    def clip_gradients(self) -> float:
        """Clip the gradient norm to config.grad_clip (<= 0: measure only); returns the norm before clipping."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))

    # ---- micro-batches ------------------------------------------------------------------------------------------------

    def micro_batches(self, batch: TrainBatch, rows: Sequence[int]) -> list[list[int]]:
        """The micro-batches (row indices) that `rows` run in: runs of actor.ppo_micro_batch_size_per_gpu, or packs
        under actor.micro_batch_tokens; a sharded rank then splits its packs up to the most any rank has
        (`agree_count`), since every rank must issue the same forwards. Packed with actor.share_vision, a prompt's
        samples that fit one pack are kept together (their image encoded once); padded, grouping them would pad
        rows of other lengths together (measured: 10% more tokens for 44 fewer encodes of 256 on geo3k-like
        lengths, a loss at 7B), so the length-sorted plan stands and shares what lands together."""
        cfg = self.config
        plan = micro_batch_rows(batch, rows, cfg.ppo_micro_batch_size_per_gpu, cfg.micro_batch_tokens,
                                cfg.padding_free, keep_groups=cfg.share_vision and cfg.padding_free)
        if cfg.micro_batch_tokens > 0:
            count = self.agree_count(len(plan))
            if count > len(plan):
                plan = split_to_count(plan, row_spans(batch), count, cfg.padding_free)
        return plan

    def agree_count(self, count: int) -> int:
        """The number of micro-batches every rank runs, given this rank's: its own on a single process."""
        return count

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the processes that share the update: itself on a single process."""
        return values

    # ---- logprobs ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, with_entropy: bool = False,
                         record_routing: bool = False, teacher: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) logprobs of the response tokens (0 on padding) and, optionally, their (B, R) entropy.
        `reference=True` uses the frozen reference (only when the KL loss is on): with LoRA, the policy itself with
        its adapters disabled. On a sharded model every rank must call it with the same number of rows (the forwards
        are collectives). `record_routing` (the old-logprob pass of a MoE policy): each row's routing is kept in
        `batch.routed_experts`, which the update replays or compares with (`routing_replay`). `teacher=True`: the
        distillation teacher's, on the same rows (its own routing, never recorded or replayed)."""
        if reference and self.peft_config is not None:
            from vlmrl.actor.lora import adapters_disabled

            with adapters_disabled(self.model):
                return self.compute_logprobs(batch, reference=False, with_entropy=with_entropy)
        model = self.teacher if teacher else self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no teacher: set algorithm.distill.teacher" if teacher else
                               "no reference model: it is loaded only when actor.use_kl_loss is true")
        frozen = reference or teacher  # no routing of the policy's is recorded or replayed
        was_training = model.training
        model.eval()
        visiting = (reference and self.reference_on_host) or (teacher and self.teacher_on_host)
        if visiting:  # actor.offload.reference: on the device for this pass only
            model.to(self.device)
        width = batch.response_mask.shape[1]
        # the weights' precision, at least float32: a float64 model's old and reference logprobs stay float64
        precision = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        logprobs = torch.zeros(batch.response_mask.shape, dtype=precision)
        entropy = torch.zeros_like(logprobs) if with_entropy else None
        engine = self.config.moe.routing_replay == "engine" and not frozen
        record = record_routing and self.routing is not None and not frozen and not engine
        routes: list[torch.Tensor | None] = [None] * len(batch)
        for rows in self.micro_batches(batch, range(len(batch))):
            mb = micro_batch(batch, rows, self.device, self.config.padding_free)
            context = (self.routing.record(mb.attended(), mb.token_lengths) if record
                       else self.routing_replay(batch, rows, mb) if engine else contextlib.nullcontext())
            with self.forward_context(model), context as recorded:
                lp, ent = forward_response(model, mb, self.temperature, with_entropy,
                                           chunk=self.config.logprob_chunk_size)
            if record:
                for position, row in enumerate(rows):
                    routes[row] = recorded[position]
            logprobs[rows] = _pad_to(lp.cpu(), width)
            if entropy is not None:
                entropy[rows] = _pad_to(ent.cpu(), width)
        model.train(was_training)
        if visiting:
            model.to("cpu")
        if record:
            batch.routed_experts = routes
        return logprobs * batch.response_mask, (entropy * batch.response_mask if entropy is not None else None)

    @torch.no_grad()
    def teacher_top_logprobs(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distillation teacher's (B, R) logprobs of the sampled tokens and, at each response position, its k
        most likely tokens' (B, R, k) logprobs and (B, R, k) ids (algorithm.distill.estimator=forward_kl_topk), in
        one pass over the micro-batches `compute_logprobs` runs; 0 (ids 0) on padding."""
        if self.teacher is None:
            raise RuntimeError("no teacher in the trainer: set algorithm.distill.teacher (teacher_engine=trainer)")
        if self.teacher_on_host:  # actor.offload.reference: on the device for this pass only
            self.teacher.to(self.device)
        width = batch.response_mask.shape[1]
        precision = torch.promote_types(next(self.teacher.parameters()).dtype, torch.float32)
        logprobs = torch.zeros(batch.response_mask.shape, dtype=precision)
        values = torch.zeros((*batch.response_mask.shape, k), dtype=precision)
        ids = torch.zeros((*batch.response_mask.shape, k), dtype=torch.long)
        for rows in self.micro_batches(batch, range(len(batch))):
            mb = micro_batch(batch, rows, self.device, self.config.padding_free)
            with self.forward_context(self.teacher):
                lp, top, top_ids = forward_top_logprobs(self.teacher, mb, k, self.temperature,
                                                        chunk=self.config.logprob_chunk_size)
            logprobs[rows] = _pad_to(lp.cpu(), width)
            values[rows, :top.shape[1]] = top.cpu().to(precision)
            ids[rows, :top_ids.shape[1]] = top_ids.cpu()
        if self.teacher_on_host:
            self.teacher.to("cpu")
        mask = batch.response_mask
        return logprobs * mask, values * mask.unsqueeze(-1), ids * mask.unsqueeze(-1).long()

    def routing_replay(self, batch: TrainBatch, rows: Sequence[int], mb: MicroBatch):
        """The update forward's routing (a context): the rows' routing recorded by the old-logprob pass replayed
        (actor.moe.routing_replay=trainer) or compared with the update's own; a dense model, or rows without a
        recorded routing, route as the model says."""
        routes = batch.routed_experts
        if self.routing is None or routes is None or all(routes[row] is None for row in rows):
            return contextlib.nullcontext()
        given = [routes[row] if routes[row] is not None  # a padding row: no routing, its own
                 else torch.full((self.routing.layers, length, self.routing.top_k), -1, dtype=torch.long)
                 for row, length in zip(rows, mb.token_lengths)]
        return self.routing.replay(given, mb.attended(), use_given=self.config.moe.routing_replay != "off")

    # ---- update -----------------------------------------------------------------------------------------------------

    def ppo_update(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                   ref_logprobs: torch.Tensor | None, mini_batch_rows: int, normalisers: Sequence[torch.Tensor],
                   token_counts: Sequence[torch.Tensor], keep_empty_micro_batches: bool,
                   loss_weights: torch.Tensor | None = None, old_from_engine: bool = False) -> dict[str, float]:
        """Policy-loss updates: ppo_epochs x len(normalisers) optimizer steps, each accumulating micro-batch
        gradients; then one lr-scheduler step (one per training step).

        Args:
            batch: B = len(normalisers) * mini_batch_rows rows; row block m is mini-batch m. Its response_mask is
                the loss mask (a row masked out by rollout correction or mask_truncated is all 0).
            old_logprobs: (B, R), or None when there is exactly one optimizer step (ratio 1, see `update`).
            advantages: (B,) sequence advantages, or (B, R) per-token ones (distillation); 0 on padding rows.
            ref_logprobs: (B, R) reference logprobs; required when the KL loss is on.
            mini_batch_rows: rows per mini-batch.
            normalisers: per mini-batch, what its aggregated loss divides by (`mini_batch_scales`): the mini-batch's
                `loss_normaliser` for actor.loss_agg_mode (single process), or the GLOBAL mini-batch's divided by
                the world size (one FSDP rank: the ranks' gradient average is then the global one).
            token_counts: per mini-batch, its token count on the same scale (weighs the token-mean metrics);
                0 = no token anywhere: the step is skipped (on every rank).
            keep_empty_micro_batches: run micro-batches without a token too (zero loss): an FSDP rank must join
                every collective the other ranks issue.
            loss_weights: (B, R) detached per-token weights multiplying the loss matrix (rollout correction);
                None = 1.

        Returns:
            metrics averaged over optimizer steps (*_min / *_max: the extreme; see `vlmrl.actor.local.Actor.update`).
        """
        cfg = self.config
        if old_logprobs is None and needs_old_logprobs(cfg, len(batch), mini_batch_rows):
            raise ValueError("old_logprobs are needed when the batch gets more than one optimizer step")
        if cfg.use_kl_loss and ref_logprobs is None:
            raise ValueError("actor.use_kl_loss is on but no reference logprobs were given")
        # in the weights' precision, at least float32 (not cast down to float32: a float64 model's loss stays float64)
        precision = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
        token_adv = broadcast_to_tokens(advantages.to(precision), batch.response_mask)  # (B, R) ones pass as they are
        self.model.train()
        steps: list[dict[str, float]] = []
        empty_steps = empty_micro_batches = non_finite = 0
        # the update's first pass over each mini-batch sees the pre-update weights (or old_logprobs holds them)
        mismatch = (MismatchAccumulator(cfg.mismatch_threshold) if cfg.mismatch_metrics and self.temperature == 1.0
                    and batch.rollout_logprobs is not None else None)
        for epoch in range(cfg.ppo_epochs):
            for normaliser, num_tokens, mini_rows in zip(normalisers, token_counts,
                                                         chunks(range(len(batch)), mini_batch_rows), strict=True):
                if num_tokens == 0:  # only padding rows (or every token masked): nothing to learn, no loss metric
                    empty_steps += 1
                    continue
                parts = self._accumulate(batch, mini_rows, normaliser, num_tokens, old_logprobs, token_adv,
                                         ref_logprobs, loss_weights, keep_empty_micro_batches,
                                         mismatch if epoch == 0 else None, old_from_engine)
                empty_micro_batches += int(parts.pop("actor/empty_micro_batches"))
                grad_norm = self.clip_gradients()
                if math.isfinite(grad_norm):  # sharded: the same global norm on every rank, so all step or none
                    self.optimizer_step()
                else:  # a NaN/inf gradient would poison the weights: skip the step, say so in the metrics
                    logger.warning("non-finite gradient norm; optimizer step skipped")
                    non_finite += 1
                parts["actor/grad_norm"] = grad_norm
                steps.append(parts)
        metrics = mean_metrics(steps) if steps else {}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        # counted, not only logged: a step that learnt from less than its batch shows on the dashboard
        metrics["actor/skipped_steps"] = float(empty_steps + non_finite)
        metrics["actor/empty_steps"] = float(empty_steps)
        metrics["actor/empty_micro_batches"] = float(empty_micro_batches)
        if mismatch is not None:
            metrics.update(mismatch.metrics())
        if self.routing is not None:
            metrics.update(self.routing.take_counts(total=self.sum_over_ranks))
        metrics.update(self.vision_counts.take(total=self.sum_over_ranks))
        self.scheduler.step()
        return metrics

    def _accumulate(self, batch: TrainBatch, mini_rows: list[int], normaliser: torch.Tensor, num_tokens: torch.Tensor,
                    old_logprobs: torch.Tensor | None, token_adv: torch.Tensor, ref_logprobs: torch.Tensor | None,
                    loss_weights: torch.Tensor | None, keep_empty_micro_batches: bool,
                    mismatch: MismatchAccumulator | None = None, old_from_engine: bool = False
                    ) -> dict[str, float]:
        """Forward/backward every micro-batch of one mini-batch; returns the mini-batch's loss parts (losses divided
        by `normaliser`, token-mean metrics weighted by the micro-batch's share of `num_tokens`: on FSDP ranks the
        average over ranks is then the global mini-batch value; ratio_min / _max are extremes; and
        actor/empty_micro_batches, how many held no policy token (skipped, or run with zero loss when
        `keep_empty_micro_batches`)). The parts are summed
        as float64 tensors on the device and read once at the end: no host sync between micro-batches."""
        cfg = self.config
        mode = cfg.loss_agg_mode
        loss_fn, loss_kwargs = POLICY_LOSS_FNS[cfg.policy_loss], cfg.policy_loss_kwargs()
        precision = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
        self.optimizer.zero_grad(set_to_none=True)
        token_means = ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "dual_clip_fraction", "ratio_mean",
                       "ppo_kl")
        start = dict.fromkeys(("actor/pg_loss", "actor/entropy", *(f"actor/{k}" for k in token_means)), 0.0)
        start.update({"actor/ratio_min": math.inf, "actor/ratio_max": -math.inf})
        if cfg.entropy_coeff:
            start["actor/entropy_loss"] = 0.0
        if cfg.use_kl_loss:
            start["actor/kl_loss"] = 0.0
        topk = batch.teacher_topk_ids is not None  # algorithm.distill.estimator=forward_kl_topk
        if batch.teacher_logprobs is not None or topk:  # algorithm.distill.mode=loss
            start["distill/loss"] = 0.0
        if topk:
            start["distill/student_topk_mass"] = 0.0
        if cfg.moe.aux_loss_coef and self.routing is not None:
            start["actor/moe_aux_loss"] = 0.0
        compare_rollout = batch.rollout_logprobs is not None and self.temperature == 1.0
        if compare_rollout:
            start["rollout/logprob_abs_diff"] = 0.0
        parts = {key: torch.full((), value, dtype=torch.float64, device=self.device) for key, value in start.items()}
        empty = 0

        def scalar(value: torch.Tensor | float) -> torch.Tensor:
            return torch.as_tensor(value, device=self.device).detach().to(torch.float64)

        for rows in self.micro_batches(batch, mini_rows):
            mb = micro_batch(batch, rows, self.device, cfg.padding_free)
            width = mb.response_width
            host_mask = batch.response_mask[rows, :width]
            share = float(host_mask.sum() / num_tokens)  # this micro-batch's weight in the mini-batch token mean
            mask = host_mask.to(self.device)
            if share == 0:  # no policy token: padding rows only, or every token masked
                empty += 1
                if not keep_empty_micro_batches:
                    continue
            aux_on = bool(cfg.moe.aux_loss_coef) and self.routing is not None
            with self.routing_replay(batch, rows, mb), (collect_aux(self.routing, mb.attended()) if aux_on
                                                        else contextlib.nullcontext()) as aux:
                with self.forward_context(self.model, self.vision_counts):
                    logprobs, entropy = forward_response(
                        self.model, mb, self.temperature, True, bool(cfg.entropy_coeff), chunk=cfg.logprob_chunk_size,
                        extra_ids=batch.teacher_topk_ids[rows, :width] if topk else None)
                if topk:  # (b, r, 1 + K): the sampled tokens', then the student's at the teacher's top-k
                    logprobs, student_topk = logprobs[..., 0], logprobs[..., 1:]
                old = logprobs.detach() if old_logprobs is None else old_logprobs[rows, :width].to(self.device)
                adv = token_adv[rows, :width].to(self.device)
                out = loss_fn(logprobs, old, adv, mask, **loss_kwargs)
                loss_mat = out.loss_mat
                if loss_weights is not None:
                    loss_mat = loss_mat * loss_weights[rows, :width].to(device=self.device, dtype=loss_mat.dtype)
                pg_loss = agg_loss(loss_mat, mask, mode, normaliser)
                loss = pg_loss
                # summed in the weights' precision (at least float32; a 16-bit autocast's entropy comes in float32): a
                # float64 model then splits exactly over micro-batches, a float32 one is unchanged
                entropy_term = agg_loss(entropy.to(precision), mask, mode, normaliser)
                parts["actor/entropy"] += scalar(entropy_term)
                if cfg.entropy_coeff:
                    loss = loss - cfg.entropy_coeff * entropy_term
                    parts["actor/entropy_loss"] += scalar(entropy_term)
                if cfg.use_kl_loss:
                    ref = ref_logprobs[rows, :width].to(self.device)
                    kl_loss = agg_loss(kl_penalty(logprobs, ref, cfg.kl_loss_type), mask, mode, normaliser)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                    parts["actor/kl_loss"] += scalar(kl_loss)
                if topk:  # coef * the forward KL over the teacher's top-k, aggregated
                    teacher_topk = batch.teacher_topk_logprobs[rows, :width].to(self.device)
                    distill_loss = forward_kl_topk_loss(student_topk, teacher_topk, mask, mode, normaliser,
                                                        self.distill.loss_max_clamp, self.distill.log_prob_min_clamp)
                    loss = loss + self.distill.coef * distill_loss
                    parts["distill/loss"] += scalar(distill_loss)
                    parts["distill/student_topk_mass"] += scalar(token_mean(topk_mass(student_topk.detach()), mask,
                                                                            num_tokens))
                elif batch.teacher_logprobs is not None:  # algorithm.distill.mode=loss: coef * reverse KL, aggregated
                    teacher_lp = batch.teacher_logprobs[rows, :width].to(self.device)
                    distill_loss = reverse_kl_loss(logprobs, teacher_lp, mask, self.distill.estimator, mode, normaliser,
                                                   self.distill.loss_max_clamp)
                    loss = loss + self.distill.coef * distill_loss
                    parts["distill/loss"] += scalar(distill_loss)
                if aux_on:  # this micro-batch's share of the mini-batch's tokens, as the token-mean metrics
                    balance = aux.value()
                    loss = loss + cfg.moe.aux_loss_coef * share * balance
                    parts["actor/moe_aux_loss"] += scalar(balance) * share
                loss.backward()
            parts["actor/pg_loss"] += scalar(pg_loss)
            m = out.metrics
            weighted = {"pg_clipfrac": m["clipfrac_low"] + m["clipfrac_high"],  # disjoint: A < 0 vs A > 0
                        "pg_clipfrac_low": m["clipfrac_low"], "pg_clipfrac_high": m["clipfrac_high"],
                        "dual_clip_fraction": m["dual_clip_fraction"], "ratio_mean": m["ratio_mean"],
                        "ppo_kl": m["approx_kl"]}
            for key, value in weighted.items():
                parts[f"actor/{key}"] += scalar(value) * share
            if share:  # a micro-batch without tokens has no ratio (its min/max are the identities +-inf)
                parts["actor/ratio_min"] = torch.minimum(parts["actor/ratio_min"], scalar(m["ratio_min"]))
                parts["actor/ratio_max"] = torch.maximum(parts["actor/ratio_max"], scalar(m["ratio_max"]))
            if compare_rollout:  # engine vs trainer: how off-policy the samples really are
                engine = batch.rollout_logprobs[rows, :width].to(self.device)
                trainer = logprobs.detach() if old_from_engine else old  # bypass: old IS the engine's
                parts["rollout/logprob_abs_diff"] += scalar(token_mean((trainer - engine).abs(), mask, num_tokens))
                if mismatch is not None:
                    mismatch.add(trainer, engine, mask, [batch.data_sources[i] if batch.data_sources else "unknown"
                                                     for i in rows],
                                 [modality(batch.multi_modal_inputs[i]) for i in rows],
                                 [batch.engines[i] for i in rows] if batch.engines else ())
        return {**dict(zip(parts, torch.stack(list(parts.values())).tolist())),  # the one host sync
                "actor/empty_micro_batches": float(empty)}
