"""From a batch of dataset rows to scored, padded training samples: the glue between data, rollout, rewards and batch.

Shared by training steps and validation, so both build requests, start backends and score responses the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from vlmrl.batch import pad_sample, prompt_inputs, required_batch_multiple, stack_samples, upsample_to_multiple
from vlmrl.config import Config, RewardConfig
from vlmrl.processors import Processor, ProcessorConfig, load_processor
from vlmrl.rewards import RewardFn, RewardInput, compute_rewards, get_reward_fn, workers_for
from vlmrl.rollout import RolloutBackend, get_backend
from vlmrl.rollout.options import backend_options as rollout_backend_options
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams, TrainBatch

if TYPE_CHECKING:
    from vlmrl.agent import AgentBatch, AgentLoop
    from vlmrl.data import RLDataset

logger = logging.getLogger(__name__)


def processor_config(config: Config) -> ProcessorConfig:
    """The processor settings a run's data section implies."""
    d = config.data
    return ProcessorConfig(min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_prompt_length=d.max_prompt_length,
                           on_overlong="filter" if d.filter_overlong_prompts else "error",
                           on_bad_image=d.on_bad_image, data_root=d.data_root,
                           allow_remote_images=d.allow_remote_images, remote_timeout_s=d.remote_timeout_s,
                           remote_max_bytes=d.remote_max_bytes, max_image_pixels=d.max_image_pixels)


def build_processor(config: Config, model_path: str | None = None) -> Processor:
    return load_processor(model_path or config.actor.model_path, processor_config(config))


def backend_options(config: Config, name: str) -> dict:
    """get_backend options from the run's rollout section (`vlmrl.rollout.options.backend_options`)."""
    d = config.data
    return rollout_backend_options(config.rollout, name, max_model_len=d.max_prompt_length + d.max_response_length,
                                   seed=config.trainer.seed)


def start_backend(config: Config, name: str | None = None, model_path: str | None = None) -> RolloutBackend:
    """Start the configured rollout backend (or `name`) on the actor's model (or `model_path`, e.g. a checkpoint)."""
    name = name or config.rollout.name
    path = model_path or config.actor.model_path
    logger.info("starting rollout backend %s on %s", name, path)
    return get_backend(name, path, **backend_options(config, name))


def load_reward_fn(config: Config, data_sources: Iterable[str]) -> RewardFn:
    """The run's reward function (reward.function). With reward.timeout_s its worker processes start now, so a
    function that cannot run in a worker stops the run here rather than after the first rollout."""
    reward_fn = get_reward_fn(config.reward.function, data_sources)
    if config.reward.timeout_s:
        workers_for(reward_fn, config.reward.num_workers)
    return reward_fn


def score(reward_fn: RewardFn, requests: Sequence[RolloutRequest], results: Sequence[RolloutResult],
          tokenizer, n: int, reward: RewardConfig) -> tuple[list[float], list[dict[str, float]], int]:
    """Reward every result (request-major, n per request): (scores, parts, failures). A failing reward function, or
    one overrunning reward.timeout_s, scores 0 with `reward_failed = 1` and the run goes on
    (vlmrl.rewards.compute_rewards)."""
    texts = tokenizer.batch_decode([r.response_ids for r in results], skip_special_tokens=True)
    return score_texts(reward_fn, requests, texts, n, reward)


def score_texts(reward_fn: RewardFn, requests: Sequence[RolloutRequest], texts: Sequence[str],
                n: int, reward: RewardConfig) -> tuple[list[float], list[dict[str, float]], int]:
    """`score` on response texts already decoded (request-major, n per request)."""
    items = []
    for i, text in enumerate(texts):
        request = requests[i // n]
        items.append(RewardInput(request.data_source, text, request.ground_truth, dict(request.extra_info)))
    return compute_rewards(reward_fn, items, timeout_s=reward.timeout_s, num_workers=reward.num_workers)


def build_train_batch(processor: Processor, config: Config, requests: Sequence[RolloutRequest],
                      results: Sequence[RolloutResult], scores: Sequence[float], parts: Sequence[dict[str, float]],
                      policy_version: int, dp_size: int = 1) -> TrainBatch:
    """Pad every result as a Sample (shared prompt inputs computed once per request), stack, then add padding rows
    up to a whole number of mini-batches that split evenly over dp_size ranks (never duplicated real rows)."""
    n = config.rollout.n
    samples = []
    for j, request in enumerate(requests):
        prompt = prompt_inputs(processor, request)
        for i in range(j * n, (j + 1) * n):
            result = results[i]
            sample = pad_sample(prompt, result.response_ids, prompt_length=config.data.max_prompt_length,
                                response_length=config.data.max_response_length, pad_token_id=processor.pad_token_id,
                                rollout_logprobs=result.response_logprobs, finish_reason=result.finish_reason,
                                policy_version=policy_version)
            sample.reward = float(scores[i])
            sample.reward_extra = dict(parts[i])
            samples.append(sample)
    batch = stack_samples(samples)
    multiple = required_batch_multiple(dp_size, config.actor.ppo_mini_batch_size, n)
    return upsample_to_multiple(batch, multiple, eos_token_id=processor.eos_token_ids[0],
                                pad_token_id=processor.pad_token_id)


# ---------------------------------------------------------------------------------------------------- agent rollout


def start_agent(config: Config, backend: RolloutBackend, processor: Processor) -> AgentLoop:
    """The multi-turn loop over the run's backend (tools built from agent.tools)."""
    from vlmrl.agent import AgentLoop

    return AgentLoop(backend, processor, config.agent, prompt_length=config.data.max_prompt_length,
                     response_length=config.data.max_response_length)


def final_answers(batch: AgentBatch) -> list[str]:
    """What the reward reads: each trajectory's last assistant turn (tool replies are not the model's answer)."""
    return [s.assistant_texts[-1] if s.assistant_texts else "" for s in batch.samples]


def agent_results(batch: AgentBatch) -> list[RolloutResult]:
    """The agent samples as RolloutResults (whole real response, tool turns included) for validation's metrics and
    artifact; logprobs are 0 on tool tokens."""
    results = []
    for agent_sample in batch.samples:
        s = agent_sample.sample
        real = s.attention_mask[s.prompt_ids.shape[0]:].bool()
        ids = s.response_ids[real].tolist()
        logprobs = s.rollout_logprobs[real].tolist() if s.rollout_logprobs is not None else [0.0] * len(ids)
        results.append(RolloutResult(s.uid, agent_sample.sample_index, ids, logprobs, s.finish_reason))
    return results


class PromptQueue:
    """Dataset indices from the BatchSampler in any amount (partial rollout asks for more or fewer than a batch)."""

    def __init__(self, sampler: Iterator[list[int]]):
        self.sampler, self.pending = sampler, []

    def take(self, count: int) -> list[int]:
        while len(self.pending) < count:
            self.pending.extend(next(self.sampler))
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken


def agent_train_batch(agent: AgentLoop, processor: Processor, config: Config, dataset: RLDataset, queue: PromptQueue,
                      reward_fn: RewardFn, sampling: SamplingParams, step: int,
                      dp_size: int = 1) -> tuple[TrainBatch, dict[str, float], int, int]:
    """One step's multi-turn rollout, scored on each trajectory's final answer and stacked like the plain path.
    Returns (batch, agent metrics, reward failures, filtered prompts)."""
    from vlmrl.data import build_requests

    size = config.data.train_batch_size
    built = build_requests(processor, dataset, queue.take(agent.prompts_needed(size)))
    if not built.requests and not agent.carried:
        raise ValueError(f"step {step}: every prompt of the batch was filtered (over data.max_prompt_length?)")
    rollout = agent.step(built.requests, sampling, batch_size=size, policy_version=step - 1)
    if not rollout.samples:
        raise RuntimeError(f"step {step}: the agent loop finished no group (see the partial rollout warning)")
    scores, parts, failures = score_texts(reward_fn, rollout.requests, final_answers(rollout), sampling.n,
                                          config.reward)
    samples = []
    for agent_sample, value, extra in zip(rollout.samples, scores, parts):
        sample = agent_sample.sample
        sample.reward = float(value)
        sample.reward_extra.update(extra)  # keeps the tools' own rewards (tool/<name>) next to the task's parts
        samples.append(sample)
    multiple = required_batch_multiple(dp_size, config.actor.ppo_mini_batch_size, sampling.n)
    batch = upsample_to_multiple(stack_samples(samples), multiple, eos_token_id=processor.eos_token_ids[0],
                                 pad_token_id=processor.pad_token_id)
    return batch, rollout.metrics, failures, built.num_skipped
