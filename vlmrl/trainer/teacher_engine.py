"""On-policy distillation's teacher scores of a step's batch (`teacher_scores`, the `teacher_logprobs` phase): from
the trainer-side teacher, or from the teacher on an engine of its own (`EngineTeacher`,
algorithm.distill.teacher_engine = hf | vllm | sglang); with estimator=forward_kl_topk also the teacher's top-k
tokens per position (the engines' prompt top-k logprobs, or the trainer-side teacher's logits).

An engine teacher scores the student's samples teacher-forced (`RolloutBackend.score`) on the very
`RolloutRequest` objects the student sampled from: the same prompt ids with one placeholder per image, the same
resized images, so the engine expands them into the same image tokens the student saw. Its logprobs go into the
(B, R) layout of the step's `TrainBatch`: row i's response tokens (those its attention mask covers) hold the
teacher's logprob of each, 0 on padding and on padding rows, as the trainer-side teacher's pass gives them.

The first step checks the engine against the trainer: algorithm.distill.engine_check_samples of the student's samples
are also scored by the teacher loaded in the trainer (an `Actor` of the teacher, as the alignment tool's trainer
side builds one on one device, then freed), and the largest |engine - trainer| logprob of their sampled tokens (and,
with forward_kl_topk, of the engine's top-k ids at each position) is logged as distill/first_step_engine_gap. Beyond the band of the two sides' dtypes the run stops with one
error line (`TeacherEngineError`). The band is the student's engine start-up probe's rule
(`vlmrl.alignment.weight_probe.tolerance_for`), so one rule says "this engine computes the trainer's model" for
the policy's engine and the teacher's: 1e-3 nats when both sides compute in float32 (the compare tool's float32 drift
tolerance; fp32 engines sit within 5e-6 of transformers on CPU, GPU kernels further), 0.5 with a bfloat16 side (a
bfloat16 model sits up to ~0.25 nats from its float32 computation, two bfloat16 implementations up to twice that).
What a wrong teacher input gives (another image, shifted image tokens, other weights) is nats on the tokens after it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vlmrl.actor.base import PolicyActor
from vlmrl.actor.config import LoraConfig, MoEConfig
from vlmrl.actor.forward import forward_response, micro_batch
from vlmrl.algorithms.config import DistillConfig
from vlmrl.algorithms.distill import TOPK_ESTIMATOR
from vlmrl.alignment.weight_probe import tolerance_for
from vlmrl.config import Config
from vlmrl.rollout.base import RolloutBackend
from vlmrl.trainer.engine_probe import EngineModelError
from vlmrl.types import RolloutRequest, TrainBatch

logger = logging.getLogger(__name__)

GAP_METRIC = "distill/first_step_engine_gap"


class TeacherEngineError(EngineModelError):
    """The first-step check found the teacher's engine scoring otherwise than the teacher in the trainer: the run
    stops (`python -m vlmrl.train` prints it as one error line)."""


@dataclass
class TeacherScores:
    """What the teacher gives a step's batch: the `teacher_logprobs` phase's output."""

    logprobs: torch.Tensor
    """(B, R) the teacher's logprob of each sampled token; 0 on padding and on padding rows."""
    topk_ids: torch.Tensor | None = None
    """(B, R, K) long: its K most likely tokens at each response position (estimator=forward_kl_topk); 0 on
    padding."""
    topk_logprobs: torch.Tensor | None = None
    """(B, R, K) their logprobs; 0 on padding."""


def teacher_scores(config: Config, actor: PolicyActor, teacher: EngineTeacher | None, batch: TrainBatch,
                   requests: Sequence[RolloutRequest]) -> tuple[TeacherScores, dict[str, float]]:
    """The step's teacher scores of the batch, and their metrics: from the trainer-side teacher (`teacher` None),
    or from the teacher's engine scoring the rows after their `requests` (at its first call also the first-step
    check). With estimator=forward_kl_topk also the teacher's top `algorithm.distill.topk` tokens per position."""
    d = config.algorithm.distill
    k = d.topk if d.estimator == TOPK_ESTIMATOR else 0
    if teacher is not None:
        return teacher.scores(config, batch, requests, k)
    if k:
        logprobs, values, ids = actor.teacher_top_logprobs(batch, k)
        return TeacherScores(logprobs, ids, values), {}
    return TeacherScores(actor.compute_logprobs(batch, teacher=True)[0]), {}


class EngineTeacher:
    """The distillation teacher on a rollout backend of its own, started with the run and closed by it."""

    def __init__(self, backend: RolloutBackend, distill: DistillConfig):
        self.backend = backend
        self.distill = distill
        self.checked = False
        """Whether this run's first-step check ran (once per process: a resumed run checks its restarted engine)."""

    def scores(self, config: Config, batch: TrainBatch, requests: Sequence[RolloutRequest], top_k: int = 0
               ) -> tuple[TeacherScores, dict[str, float]]:
        """The batch's teacher scores from the engine (with `top_k`, its top-k per position too), and at the first
        call the check's distill/first_step_engine_gap (raises TeacherEngineError beyond its band). The engine
        frees its memory afterwards where it was started for that (a GPU)."""
        scores = engine_scores(self.backend, batch, requests, top_k)
        if self.backend.releases_memory():
            self.backend.sleep()
        metrics: dict[str, float] = {}
        if not self.checked and self.distill.engine_check_samples > 0:
            metrics[GAP_METRIC] = first_step_check(config, batch, scores, self.backend)
        self.checked = True
        return scores, metrics

    def close(self) -> None:
        self.backend.close()


def engine_scores(backend: RolloutBackend, batch: TrainBatch, requests: Sequence[RolloutRequest], top_k: int = 0
                  ) -> TeacherScores:
    """`backend`'s teacher-forced scores of every real row's response tokens, each scored after the row's own
    request (found by uid among `requests`), laid out as the batch: (B, R) float32 logprobs and (top_k > 0) the
    (B, R, top_k) top-k ids and logprobs, largest first, times the response mask; 0 on padding rows."""
    by_uid = {request.uid: request for request in requests}
    rows = [i for i in range(len(batch)) if not bool(batch.is_padding[i])]
    missing = sorted({batch.uids[i] for i in rows} - by_uid.keys())
    if missing:
        raise RuntimeError(f"teacher engine: no request for the batch rows of uid(s) {missing[:3]} (of "
                           f"{len(missing)}); the step's requests must include every row's")
    lengths = batch.attention_mask[:, batch.prompt_length:].sum(-1).tolist()  # (B,) real response tokens
    responses = [batch.response_ids[i, :lengths[i]].tolist() for i in rows]
    scored = backend.score_top([by_uid[batch.uids[i]] for i in rows], responses, top_k)
    mask = batch.response_mask
    logprobs = torch.zeros(mask.shape, dtype=torch.float32)
    ids = torch.zeros((*mask.shape, top_k), dtype=torch.long)
    values = torch.zeros((*mask.shape, top_k), dtype=torch.float32)
    for i, record in zip(rows, scored):
        logprobs[i, :len(record.logprobs)] = torch.tensor(record.logprobs, dtype=torch.float32)
        for t, top in enumerate(record.top):  # largest first, as the trainer-side teacher's
            ranked = sorted(top.items(), key=lambda item: -item[1])
            ids[i, t] = torch.tensor([token for token, _ in ranked])
            values[i, t] = torch.tensor([value for _, value in ranked])
    if not top_k:
        return TeacherScores(logprobs * mask)
    return TeacherScores(logprobs * mask, ids * mask.unsqueeze(-1).long(), values * mask.unsqueeze(-1))


def check_rows(batch: TrainBatch, count: int) -> list[int]:
    """The first `count` real rows that hold a response token: the samples the first-step check scores twice."""
    real = [i for i in range(len(batch)) if not bool(batch.is_padding[i]) and bool(batch.response_mask[i].any())]
    return real[:count]


def trainer_side_teacher(config: Config):
    """The teacher as the alignment tool's trainer side builds a policy on one device
    (`vlmrl.trainer.teacher_forcing.scoring_actor`): an `Actor` of the teacher in teacher_dtype, at temperature 1
    (the raw distribution the engines score), without LoRA, KL reference or routing replay."""
    from vlmrl.actor.local import Actor

    d = config.algorithm.distill
    actor_config = replace(config.actor, model_path=d.teacher, dtype=d.teacher_dtype, compute_dtype=d.teacher_dtype,
                           use_kl_loss=False, lora=LoraConfig(), moe=MoEConfig(), gradient_checkpointing=False)
    return Actor(actor_config, total_steps=1, mini_batch_samples=config.derived.mini_batch_samples, temperature=1.0)


def first_step_check(config: Config, batch: TrainBatch, engine: TeacherScores, backend: RolloutBackend) -> float:
    """The largest |engine - trainer| teacher logprob over the tokens of the check's rows (`check_rows`): of the
    sampled tokens and (forward_kl_topk) of the engine's top-k ids at each position, the trainer's from the teacher
    loaded in the trainer for this check only (so wrong ids show as well as wrong values, and a near-tie that orders
    two ids otherwise changes nothing); raises TeacherEngineError beyond the band of the two sides' dtypes (the
    module docstring)."""
    rows = check_rows(batch, config.algorithm.distill.engine_check_samples)
    if not rows:
        return 0.0
    chosen = batch.select(rows)
    ids = None if engine.topk_ids is None else engine.topk_ids[rows]
    actor = trainer_side_teacher(config)
    try:
        trainer = trainer_scores_at(actor, chosen, ids)
        trainer_dtype = str(actor.forward_dtype()).removeprefix("torch.")
    finally:
        del actor  # the check's copy of the teacher: its memory goes back before the update
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    scored = engine.logprobs[rows].unsqueeze(-1)  # (b, R, 1 + K): the sampled token's, then the top-k's
    if ids is not None:
        scored = torch.cat([scored, engine.topk_logprobs[rows]], dim=-1)
    gap, row, column, slot = largest_gap(scored, trainer, chosen.response_mask)
    band, _ = tolerance_for(backend.dtype, trainer_dtype)
    tokens = int((chosen.response_mask != 0).sum())
    logger.info("distillation teacher: engine %s (%s) vs the teacher in the trainer (%s) on %d samples, %d tokens%s: "
                "max |diff| %.3g (band %g)", backend.name, backend.dtype, trainer_dtype, len(rows), tokens,
                "" if ids is None else f" and their top-{ids.shape[-1]}", gap, band)
    if gap > band:
        d = config.algorithm.distill
        which = "the sampled token" if slot == 0 else f"top-{slot} id {int(ids[row, column, slot - 1])}"
        raise TeacherEngineError(
            f"algorithm.distill.teacher_engine={d.teacher_engine}: the teacher's engine scores the student's samples "
            f"otherwise than the teacher {d.teacher} in the trainer: {GAP_METRIC}={gap:.3g} nats > {band:g} (the "
            f"band of {backend.dtype} vs {trainer_dtype}); first at sample {rows[row]} (uid {chosen.uids[row]}), "
            f"response token {column}, {which}: engine {scored[row, column, slot]:.6f} vs trainer "
            f"{trainer[row, column, slot]:.6f}. Compare the teacher's engine with the trainer on it (python -m "
            "vlmrl.alignment.compare --backends trainer,<engine> with actor.model_path=<teacher>), or set "
            "algorithm.distill.engine_check_samples=0 to skip this check")
    return gap


@torch.no_grad()
def trainer_scores_at(actor, batch: TrainBatch, ids: torch.Tensor | None) -> torch.Tensor:
    """(B, R, 1 + K) float32: the actor's logprobs (temperature 1) of each response token and, with `ids` (B, R, K),
    of those ids at its position; one pass over the micro-batches its logprob pass runs, 0 on padding."""
    width = batch.response_mask.shape[1]
    out = torch.zeros((*batch.response_mask.shape, 1 + (0 if ids is None else ids.shape[-1])), dtype=torch.float32)
    actor.model.eval()
    for rows in actor.micro_batches(batch, range(len(batch))):
        mb = micro_batch(batch, rows, actor.device, actor.config.padding_free)
        extra = None if ids is None else ids[rows, :mb.response_width].to(actor.device)
        with actor.forward_context(actor.model):
            logprobs, _ = forward_response(actor.model, mb, 1.0, False, chunk=actor.config.logprob_chunk_size,
                                           extra_ids=extra)
        logprobs = logprobs if extra is not None else logprobs.unsqueeze(-1)
        out[rows, :min(logprobs.shape[1], width)] = logprobs.float().cpu()
    return out * batch.response_mask[..., None]


def largest_gap(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> tuple[float, int, int, int]:
    """(max |engine - trainer| over the mask's tokens, its row, its column, its slot) of (B, R, J) values (J per
    token: the sampled token's and the top-k's): the first such value in row-major order when several tie; (0.0, 0,
    0, 0) without a token.

    >>> largest_gap(torch.tensor([[[-1.0], [-2.0]]]), torch.tensor([[[-1.5], [-2.0]]]), torch.ones(1, 2))
    (0.5, 0, 0, 0)
    """
    diff = (engine.double() - trainer.double()).abs() * (mask != 0).unsqueeze(-1)
    if not bool((mask != 0).any()):
        return 0.0, 0, 0, 0
    flat = int(torch.argmax(diff.flatten()))
    row, rest = divmod(flat, diff.shape[1] * diff.shape[2])
    column, slot = divmod(rest, diff.shape[2])
    return float(diff[row, column, slot]), row, column, slot
