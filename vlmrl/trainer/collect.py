"""A step's batch: its prompts rolled out (plain or multi-turn, through the run's placement), every sample scored,
dynamic sampling's groups kept, and the samples stacked with padding rows into the `TrainBatch` the update takes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl.algorithms.dapo import groups_with_signal, overlong_penalty, select_groups
from vlmrl.batch.padding import pad_results, scored_batch
from vlmrl.config import Config
from vlmrl.data.dataset import RequestBatch, build_requests
from vlmrl.rewards.base import TIMEOUT_KEY
from vlmrl.rewards.scoring import response_texts
from vlmrl.rollout.segments import generate_in_segments
from vlmrl.trainer.run import PhaseTimer, Rollout, Run, StepBatch
from vlmrl.trainer.throughput import throughput_metrics
from vlmrl.types import RolloutRequest, RolloutResult, Sample, SamplingParams, TrainBatch

logger = logging.getLogger(__name__)


def collect_step(run: Run, step: int, timer: PhaseTimer) -> StepBatch:
    """Step `step`'s batch: roll out its prompts (plain or multi-turn, timing/rollout), score every sample
    (timing/reward; DAPO's overlong shaping added to the rewards), keep the groups the batch takes, and stack them.
    With algorithm.dynamic_sampling only groups with reward signal are kept (`select_groups`) and more prompts are
    drawn, from the same (checkpointed) sampler with a seed that depends only on (trainer.seed, step, draw), until
    data.train_batch_size groups have signal or algorithm.dynamic_sampling_max_extra_draws extra draws are spent;
    then the step trains on what it has."""
    cfg, al = run.config, run.config.algorithm
    wanted = cfg.data.train_batch_size
    kept = Scored([], [], [], [])
    requests: list[RolloutRequest] = []  # every draw's: the kept rows' requests among them
    failures = filtered = groups = dropped = surplus = draw = 0
    while True:
        sampling = training_sampling(cfg, step, draw)
        with timer("rollout"):  # plain, multi-turn, or taken from the asynchronous placement's rollout thread
            rollout = run.placement.collect(run, step, sampling)
        requests += rollout.requests
        with timer("reward"):
            scored, draw_failures = score_rollout(run, rollout, sampling)
        failures, filtered = failures + draw_failures, filtered + rollout.filtered
        if al.dynamic_sampling:
            pick = select_groups(torch.tensor(scored.rewards, dtype=torch.float64),
                                 [s.uid for s in scored.samples], room=wanted - groups)
            groups, dropped, surplus = groups + pick.taken, dropped + pick.dropped, surplus + pick.surplus
            rows = pick.rows
            last_chance = groups >= wanted or draw >= al.dynamic_sampling_max_extra_draws
            if not kept.samples and not rows and last_chance:
                logger.warning("step %d: no group with reward signal in %d draws: training on the last draw's groups "
                               "(their advantages are 0)", step, draw + 1)
                rows = list(range(len(scored.samples)))
            kept = kept + scored.select(rows)
        else:
            kept = scored
        if not al.dynamic_sampling or groups >= wanted or draw >= al.dynamic_sampling_max_extra_draws:
            break
        draw += 1
    metrics = dict(rollout.metrics)
    if al.dynamic_sampling:
        if groups < wanted:
            logger.warning("step %d: %d of %d groups with reward signal after %d extra draws (algorithm."
                           "dynamic_sampling_max_extra_draws); training on those", step, groups, wanted, draw)
        metrics.update({"batch/dynamic_sampling_draws": float(draw), "batch/groups_dropped": float(dropped),
                        "batch/groups_surplus": float(surplus)})
    if al.overlong_buffer_len > 0:
        metrics["reward/overlong_penalty"] = sum(kept.penalties) / max(len(kept.penalties), 1)
    with timer("reward"):
        processor = run.parts.processor
        batch = scored_batch(kept.samples, kept.rewards, kept.parts,
                             multiple=cfg.derived.batch_multiple,
                             eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)
    return StepBatch(batch, metrics, failures, filtered, rollout.engine_version, requests)


@dataclass
class Scored:
    """Samples with their rewards (shaping included), reward parts and overlong penalties, row for row."""

    samples: list[Sample]
    rewards: list[float]
    parts: list[dict[str, float]]
    penalties: list[float]

    def select(self, rows: list[int]) -> Scored:
        return Scored(*([column[i] for i in rows] for column in (self.samples, self.rewards, self.parts,
                                                                  self.penalties)))

    def __add__(self, other: Scored) -> Scored:
        return Scored(self.samples + other.samples, self.rewards + other.rewards, self.parts + other.parts,
                      self.penalties + other.penalties)


def score_rollout(run: Run, rollout: Rollout, sampling: SamplingParams) -> tuple[Scored, int]:
    """The reward of every sample of a rollout, with DAPO's overlong shaping added (algorithm.overlong_buffer_len);
    returns them and the number of samples whose reward function failed."""
    cfg, al = run.config, run.config.algorithm
    scores = run.parts.reward.score(rollout.requests, rollout.answers, sampling.n)
    values = torch.tensor(scores.values, dtype=torch.float64)
    penalty = torch.zeros_like(values)
    if al.overlong_buffer_len > 0:
        lengths = torch.tensor([int(s.attention_mask[len(s.prompt_ids):].sum()) for s in rollout.samples])
        penalty = overlong_penalty(lengths, cfg.data.max_response_length, al.overlong_buffer_len,
                                   al.overlong_penalty_factor).to(torch.float64)
        values = values + penalty
    return Scored(list(rollout.samples), values.tolist(), list(scores.parts), penalty.tolist()), scores.failures


def plain_rollout(run: Run, step: int, sampling: SamplingParams, policy_version: int | None = None,
                  segment_tokens: int = 0, between: Callable[[], int] | None = None) -> Rollout:
    """The next batch of prompts, generated in one backend call and padded per sample. `policy_version`: the step
    whose weights the engine holds (default step - 1: the synchronous loop's). `segment_tokens` > 0 (the
    asynchronous placement's interrupt_tokens): generated in segments, the trainer's waiting calls let in between
    them (`between`, `vlmrl.rollout.segments`); its samples whose segments had different weights are counted
    (async/mixed_version_samples)."""
    rows = list(next(run.sampler))
    built = build_requests(run.parts.processor, run.train_data, rows)
    if not built.requests:
        raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
    version = run.engine_version
    if segment_tokens > 0:
        results, versions = generate_in_segments(run.parts.backend, built.requests, sampling, segment_tokens,
                                                 version, between=between)
    else:
        results = run.parts.backend.generate(built.requests, sampling)
    rollout = finish_rollout(run, built, rows, results, version,
                             step - 1 if policy_version is None else policy_version)
    if segment_tokens > 0:
        rollout.metrics["async/mixed_version_samples"] = float(sum(first != last for first, last in versions))
    return rollout


def finish_rollout(run: Run, built: RequestBatch, rows: list[int], results: list[RolloutResult], engine_version: int,
                   policy_version: int) -> Rollout:
    """A plain rollout from its requests (`build_requests` of `rows`) and the engine's results: padded per sample,
    the responses decoded."""
    d = run.config.data
    samples = pad_results([run.parts.processor.prompt_inputs(r) for r in built.requests], results,
                          prompt_length=d.max_prompt_length, response_length=d.max_response_length,
                          pad_token_id=run.parts.processor.pad_token_id, policy_version=policy_version)
    texts = response_texts(run.parts.processor.tokenizer, results)
    return Rollout(built.requests, samples, texts, {}, built.num_skipped, engine_version, rows, results)


def agent_rollout(run: Run, step: int, sampling: SamplingParams) -> Rollout:
    """Multi-turn conversations for a batch of prompts (with partial rollout: carried groups first, then new ones
    from the prompt queue, until a batch of groups has finished); each trajectory is padded as it ends."""
    size = run.config.data.train_batch_size
    built = build_requests(run.parts.processor, run.train_data, run.prompts.take(run.parts.agent.prompts_needed(size)))
    if not built.requests and not run.parts.agent.carried:
        raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
    rolled = run.parts.agent.step(built.requests, sampling, batch_size=size, policy_version=step - 1)
    if not rolled.samples:
        raise RuntimeError(f"step {step}: the agent loop finished no group (see the partial rollout warning)")
    return Rollout(rolled.requests, rolled.train_samples, rolled.final_answers, rolled.metrics, built.num_skipped,
                   run.engine_version)


def step_metrics(collected: StepBatch, run: Run, timer: PhaseTimer, actor_metrics: dict[str, float] | None = None
                 ) -> dict[str, float]:
    """Metrics beyond batch_metrics and the actor's: reward failures and timeouts (timeouts are failures too),
    filtered prompts, groups with signal, the response tokens per second of the step so far, and the step's tokens/s
    per GPU and the update's MFU (vlmrl.trainer.throughput)."""
    batch = collected.batch
    real = ~batch.is_padding
    tokens = float((batch.response_mask * real.unsqueeze(-1)).sum())
    return {
        "reward/failures": float(collected.reward_failures),
        "reward/timeouts": float(sum(extra.get(TIMEOUT_KEY, 0.0) for extra in batch.reward_extra)),  # padding rows: {}
        "batch/filtered_prompts": float(collected.filtered_prompts),
        "batch/groups_with_signal": _share_of_groups_with_signal(batch),
        "epoch": float(run.data_state()["epoch"]),
        "throughput/response_tokens_per_s": tokens / max(timer.elapsed(), 1e-9),
        **throughput_metrics(run.config, batch, timer.elapsed(), timer.seconds["update"], actor_metrics),
    }


def _share_of_groups_with_signal(batch: TrainBatch) -> float:
    """Fraction of prompts whose samples got different rewards (the same rule dynamic sampling and the group
    estimators use)."""
    real_groups = {uid for uid, padding in zip(batch.uids, batch.is_padding.tolist()) if not padding}
    return len(groups_with_signal(batch.rewards, batch.uids, batch.is_padding)) / max(len(real_groups), 1)


def training_sampling(config: Config, step: int, draw: int = 0) -> SamplingParams:
    """Sampling of step `step`'s draw `draw` (0, then dynamic sampling's extra draws): seeded by (trainer.seed,
    step, draw) only, so a resumed run draws what an uninterrupted one would."""
    r = config.rollout
    seed = (config.trainer.seed * 7_919 + step * 1_000_003 + draw * 104_729) % (2**31)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=config.data.max_response_length, seed=seed)
