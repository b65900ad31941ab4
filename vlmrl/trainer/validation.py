"""Validation: generate on the held-out set, score, aggregate per data source, optionally write the artifact.

`run_validation(parts)` validates a run's components (`vlmrl.trainer.components.RunComponents`): the fit loop calls
it with its own, validate-only mode (which `python -m vlmrl.alignment.compare --backends` runs once per backend) through
`validate_with(config, backend_name)`, which builds them (requests first, then the reward and the engine) and
closes them, the reward's worker processes and judge with them.

Every dataset row is validated exactly once, in order, in generate calls of `data.val_batch_size` prompts; a short
last call is simply shorter. Validation builds no training batch, so it never needs padding rows, and it never
duplicates a sample to fill a batch (duplicates would bias the accuracy).

Metrics (a sample's accuracy is its reward part `accuracy` when the reward function returns one, else its score):
  val/accuracy, val/<data_source>/accuracy      mean over samples (= mean@k when rollout.val_n = k > 1)
  val/reward, val/<data_source>/reward          mean score (e.g. geo3k: 0.9 * accuracy + 0.1 * format)
  val/reward_extra/<part>                       mean of each named reward part
  val/mean@k, val/pass@k (+ per data source)    when k > 1: mean accuracy, and the share of prompts with a correct
                                                sample
  val/response_length/mean, val/num_prompts, val/num_samples, val/filtered_prompts, val/reward_failures
  val/reward_timeouts                           samples whose reward overran reward.timeout_s (also failures)
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from vlmrl.alignment.artifact import (
    ArtifactMeta,
    DatasetIdentity,
    ValidationRecord,
    engine_info,
    file_fingerprint,
    records_from_rollout,
    weights_fingerprint,
    write_artifact,
)
from vlmrl.config import Config, to_dict
from vlmrl.data.dataset import RLDataset, build_requests, load_dataset, sequential_batches
from vlmrl.processors.base import Processor
from vlmrl.rewards.base import TIMEOUT_KEY
from vlmrl.rewards.scoring import RewardScorer, response_texts
from vlmrl.trainer.components import RunComponents, load_run_processor, start_agent, start_run_backend
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ValidationResult:
    metrics: dict[str, float]
    artifact_path: Path | None
    records: list[ValidationRecord] | None
    """The artifact's records (only when an artifact was written)."""


def validation_sampling(config: Config, top_logprobs: int = 0) -> SamplingParams:
    r = config.rollout
    return SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k,
                          max_new_tokens=config.data.max_response_length, seed=config.trainer.seed,
                          top_logprobs=top_logprobs)


def load_val_dataset(config: Config) -> RLDataset:
    d = config.data
    return load_dataset(d.val_files, "val", prompt_key=d.prompt_key, image_key=d.image_key,
                        synthetic_train_size=d.synthetic_train_size, synthetic_val_size=d.synthetic_val_size,
                        synthetic_seed=config.trainer.seed)


@dataclass
class ValidationRequests:
    """Every request of the validation set, in generate calls of data.val_batch_size prompts."""

    calls: list[list[RolloutRequest]]
    filtered: int
    """Rows the processor skipped (over data.max_prompt_length, bad images with data.on_bad_image=filter)."""


def build_validation_requests(config: Config, processor: Processor, dataset: RLDataset) -> ValidationRequests:
    """The validation set's requests; a bad row raises naming its row, file and cause (build them before any engine
    starts), and a set whose every row is filtered raises too."""
    built = [build_requests(processor, dataset, indices)
             for indices in sequential_batches(len(dataset), config.data.val_batch_size)]
    calls = [batch.requests for batch in built if batch.requests]
    if not calls:
        raise ValueError(f"validation: every one of the {len(dataset)} rows of {dataset.spec} was filtered; raise "
                         "data.max_prompt_length or check the images")
    return ValidationRequests(calls, sum(batch.num_skipped for batch in built))


def validate_with(config: Config, backend: str | None = None, *, step: int = 0,
                  artifact_path: str | os.PathLike | None = None) -> ValidationResult:
    """Validate-only: build every request first (a bad row fails in seconds, naming its row, file and cause, not
    after an engine start: 25-90 s on 2 CPU cores), then the reward (`RewardScorer`), the backend (`backend`, or
    rollout.name, on `config.actor.model_path`) and, with agent.enable, the agent loop; validate; close them (also
    when a start fails: what started before it is closed)."""
    processor = load_run_processor(config)
    dataset = load_val_dataset(config)
    requests = build_validation_requests(config, processor, dataset)
    reward = RewardScorer.start(config.reward, dataset.data_sources())
    try:
        parts = RunComponents(config, processor, reward, start_run_backend(config, backend), dataset)
    except BaseException:
        reward.close()
        raise
    try:
        if config.agent.enable:
            parts.agent = start_agent(config, parts.backend, processor)
        return run_validation(parts, step=step, artifact_path=artifact_path, requests=requests)
    finally:
        parts.close()


def run_validation(parts: RunComponents, *, step: int = 0, artifact_path: str | os.PathLike | None = None,
                   requests: ValidationRequests | None = None) -> ValidationResult:
    """Validate the run's components on their validation set (`parts.val_data`); write the per-sample artifact when
    `artifact_path` is given. `step`: the training step of the weights (recorded in the artifact); `requests`: the
    set's requests when already built (`build_validation_requests`). With an agent loop, samples are scored on their
    last assistant turn; their response is the whole conversation."""
    config, processor, dataset, running = parts.config, parts.processor, parts.val_data, parts.backend
    if dataset is None:
        raise ValueError("validation needs data.val_files")
    requests = requests or build_validation_requests(config, processor, dataset)
    sampling = validation_sampling(config, config.rollout.val_top_logprobs if artifact_path else 0)
    results: list[RolloutResult] = []
    answers: list[str] = []  # what the reward reads: the response, or an agent trajectory's last assistant turn
    routings: list = []
    capture = artifact_path is not None and parts.agent is None and captures_routing(config, running, processor,
                                                                                     sampling)
    for call in requests.calls:
        if parts.agent is not None:
            rolled = parts.agent.run(call, sampling, policy_version=step)
            results.extend(rolled.results)
            answers.extend(rolled.final_answers)
        else:
            generated = running.generate(call, sampling)
            if capture:
                routings.extend(result.routed_experts for result in generated)
            results.extend(generated)
            answers.extend(response_texts(processor.tokenizer, generated))
    filtered = requests.filtered
    requests = [request for call in requests.calls for request in call]
    scores = parts.reward.score(requests, answers, sampling.n)
    metrics = validation_metrics(requests, results, scores.values, scores.parts, sampling.n)
    metrics.update({"val/filtered_prompts": float(filtered), "val/reward_failures": float(scores.failures),
                    "val/reward_timeouts": float(sum(p.get(TIMEOUT_KEY, 0.0) for p in scores.parts))})
    records = None
    path = None
    if artifact_path is not None:
        records = records_from_rollout(requests, results, scores.values, processor, scores.parts)
        if routings:
            from vlmrl.alignment.routing import encode_routing

            for record, routing in zip(records, routings, strict=True):
                record.routing = encode_routing(routing)
        engine, version = engine_info(running.name)
        meta = ArtifactMeta(
            backend=running.name, engine=engine, engine_version=version, model_path=config.actor.model_path,
            dataset=DatasetIdentity(paths=[str(f) for f in dataset.files], rows=len(dataset),
                                    fingerprint=file_fingerprint(dataset.files)),
            sampling=asdict(sampling), config=to_dict(config), step=step, dtype=running.dtype,
            logprobs_mode=running.logprobs_mode, engine_problems=engine_problems_of(config, running, processor),
            weights=weights_fingerprint(config.actor.model_path) if config.trainer.val_only else "")
        path = write_artifact(artifact_path, meta, records)
        logger.info("validation artifact: %s (%d samples)", path, len(records))
    return ValidationResult(metrics, path, records)


def engine_problems_of(config, running, processor) -> list[str]:
    """What the family says the engine computes otherwise than transformers on this model: only an engine started
    without vlmrl's settings (rollout.family_engine_settings=false) can have any, since vlmrl refuses to start one
    whose problems its overrides leave."""
    if running.name not in ("vllm", "sglang", "sglang-server") or config.rollout.family_engine_settings:
        return []
    from vlmrl.models.families import read_model_config

    return processor.family.engine_problems(read_model_config(running.model_path), running.name)


def captures_routing(config, running, processor, sampling) -> bool:
    """A MoE model's backend whose results carry the engine's routing (rollout.vllm.capture_routing,
    rollout.sglang.capture_routing), one sample per request: each validation sample's routing goes into the
    artifact."""
    if processor.family.experts is None or not getattr(running, "captures_routing", lambda: False)():
        return False
    if sampling.n != 1:
        logger.warning("the engine's routing is recorded with one sample per request (rollout.val_n=1); the artifact "
                       "records no routing")
        return False
    return True


def validation_metrics(requests: Sequence[RolloutRequest], results: Sequence[RolloutResult], scores: Sequence[float],
                       parts: Sequence[dict[str, float]], n: int) -> dict[str, float]:
    """Aggregate per-sample scores (request-major, n per request) overall and per data source (see module doc)."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for i in range(len(results)):
        by_source[requests[i // n].data_source].append(i)
    accuracy = [p.get("accuracy", s) for s, p in zip(scores, parts)]
    metrics: dict[str, float] = {}

    def aggregate(prefix: str, samples: list[int]) -> None:
        metrics[f"{prefix}accuracy"] = sum(accuracy[i] for i in samples) / len(samples)
        metrics[f"{prefix}reward"] = sum(scores[i] for i in samples) / len(samples)
        if n > 1:
            prompts = sorted({i // n for i in samples})
            metrics[f"{prefix}mean@{n}"] = metrics[f"{prefix}accuracy"]
            best = [max(accuracy[j * n + k] for k in range(n)) for j in prompts]
            metrics[f"{prefix}pass@{n}"] = sum(1.0 for b in best if b >= 1.0) / len(prompts)

    aggregate("val/", list(range(len(results))))
    for source, samples in sorted(by_source.items()):
        aggregate(f"val/{source}/", samples)
    for name in sorted({k for p in parts for k in p}):
        metrics[f"val/reward_extra/{name}"] = sum(p.get(name, 0.0) for p in parts) / len(parts)
    metrics["val/response_length/mean"] = sum(len(r.response_ids) for r in results) / len(results)
    metrics["val/num_prompts"] = float(len(requests))
    metrics["val/num_samples"] = float(len(results))
    return metrics
