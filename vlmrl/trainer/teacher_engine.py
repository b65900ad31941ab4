"""On-policy distillation's teacher on an engine of its own (`EngineTeacher`, algorithm.distill.teacher_engine = hf |
vllm | sglang): what the step's `teacher_logprobs` phase asks instead of the trainer-side teacher.

An engine teacher scores the student's samples teacher-forced (`RolloutBackend.score`) on the very
`RolloutRequest` objects the student sampled from: the same prompt ids with one placeholder per image, the same
resized images, so the engine expands them into the same image tokens the student saw. Its logprobs go into the
(B, R) layout of the step's `TrainBatch`: row i's response tokens (those its attention mask covers) hold the
teacher's logprob of each, 0 on padding and on padding rows, as the trainer-side teacher's pass gives them.

The first step checks the engine against the trainer: algorithm.distill.engine_check_samples of the student's samples
are also scored by the teacher loaded in the trainer (an `Actor` of the teacher, as the alignment tool's trainer
side builds one on one device, then freed), and the largest |engine -
trainer| over their tokens is logged as distill/first_step_engine_gap. Beyond the band of the two sides' dtypes the
run stops with one error line (`TeacherEngineError`). The band is the student's engine start-up probe's rule
(`vlmrl.alignment.weight_probe.tolerance_for`), so one rule says "this engine computes the trainer's model" for the
policy's engine and the teacher's: 1e-3 nats when both sides compute in float32 (the compare tool's float32 drift
tolerance; fp32 engines sit within 5e-6 of transformers on CPU, GPU kernels further), 0.5 with a bfloat16 side (a
bfloat16 model sits up to ~0.25 nats from its float32 computation, two bfloat16 implementations up to twice that).
What a wrong teacher input gives (another image, shifted image tokens, other weights) is nats on the tokens after it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from vlmrl.actor.config import LoraConfig, MoEConfig
from vlmrl.algorithms.config import DistillConfig
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


class EngineTeacher:
    """The distillation teacher on a rollout backend of its own, started with the run and closed by it."""

    def __init__(self, backend: RolloutBackend, distill: DistillConfig):
        self.backend = backend
        self.distill = distill
        self.checked = False
        """Whether this run's first-step check ran (once per process: a resumed run checks its restarted engine)."""

    def logprobs(self, config: Config, batch: TrainBatch, requests: Sequence[RolloutRequest]
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """(B, R) teacher logprobs of the batch's sampled tokens from the engine, and at the first call the check's
        distill/first_step_engine_gap (raises TeacherEngineError beyond its band). The engine frees its memory
        afterwards where it was started for that (a GPU)."""
        scores = engine_scores(self.backend, batch, requests)
        if self.backend.releases_memory():
            self.backend.sleep()
        metrics: dict[str, float] = {}
        if not self.checked and self.distill.engine_check_samples > 0:
            metrics[GAP_METRIC] = first_step_check(config, batch, scores, self.backend)
        self.checked = True
        return scores, metrics

    def close(self) -> None:
        self.backend.close()


def engine_scores(backend: RolloutBackend, batch: TrainBatch, requests: Sequence[RolloutRequest]) -> torch.Tensor:
    """(B, R) float32: `backend`'s teacher-forced logprob of each response token of every real row, scored after the
    row's own request (found by uid among `requests`), times the response mask; 0 on padding rows."""
    by_uid = {request.uid: request for request in requests}
    rows = [i for i in range(len(batch)) if not bool(batch.is_padding[i])]
    missing = sorted({batch.uids[i] for i in rows} - by_uid.keys())
    if missing:
        raise RuntimeError(f"teacher engine: no request for the batch rows of uid(s) {missing[:3]} (of "
                           f"{len(missing)}); the step's requests must include every row's")
    lengths = batch.attention_mask[:, batch.prompt_length:].sum(-1).tolist()  # (B,) real response tokens
    responses = [batch.response_ids[i, :lengths[i]].tolist() for i in rows]
    scored = backend.score([by_uid[batch.uids[i]] for i in rows], responses)
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for i, lps in zip(rows, scored):
        out[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return out * batch.response_mask


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


def first_step_check(config: Config, batch: TrainBatch, engine: torch.Tensor, backend: RolloutBackend) -> float:
    """The largest |engine - trainer| teacher logprob over the tokens of the check's rows (`check_rows`), the
    trainer's from the teacher loaded in the trainer for this check only; raises TeacherEngineError beyond the
    band of the two sides' dtypes (the module docstring)."""
    rows = check_rows(batch, config.algorithm.distill.engine_check_samples)
    if not rows:
        return 0.0
    chosen = batch.select(rows)
    actor = trainer_side_teacher(config)
    try:
        trainer, _ = actor.compute_logprobs(chosen)
        trainer_dtype = str(actor.forward_dtype()).removeprefix("torch.")
    finally:
        del actor  # the check's copy of the teacher: its memory goes back before the update
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    gap, row, column = largest_gap(engine[rows], trainer, chosen.response_mask)
    band, _ = tolerance_for(backend.dtype, trainer_dtype)
    tokens = int((chosen.response_mask != 0).sum())
    logger.info("distillation teacher: engine %s (%s) vs the teacher in the trainer (%s) on %d samples, %d tokens: "
                "max |diff| %.3g (band %g)", backend.name, backend.dtype, trainer_dtype, len(rows), tokens, gap, band)
    if gap > band:
        d = config.algorithm.distill
        raise TeacherEngineError(
            f"algorithm.distill.teacher_engine={d.teacher_engine}: the teacher's engine scores the student's samples "
            f"otherwise than the teacher {d.teacher} in the trainer: {GAP_METRIC}={gap:.3g} nats > {band:g} (the "
            f"band of {backend.dtype} vs {trainer_dtype}); first at sample {rows[row]} (uid {chosen.uids[row]}), "
            f"response token {column}: engine {engine[rows[row], column]:.6f} vs trainer {trainer[row, column]:.6f}. "
            "Compare the teacher's engine with the trainer on it (python -m vlmrl.alignment.compare "
            "--backends trainer,<engine> with actor.model_path=<teacher>), or set "
            "algorithm.distill.engine_check_samples=0 to skip this check")
    return gap


def largest_gap(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> tuple[float, int, int]:
    """(max |engine - trainer| over the mask's tokens, its row, its column): the first such token in row-major order
    when several tie; (0.0, 0, 0) without a token.

    >>> largest_gap(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2))
    (0.5, 0, 0)
    """
    diff = (engine.double() - trainer.double()).abs() * (mask != 0)
    if not bool((mask != 0).any()):
        return 0.0, 0, 0
    flat = int(torch.argmax(diff.flatten()))
    row, column = divmod(flat, diff.shape[1])
    return float(diff[row, column]), row, column
