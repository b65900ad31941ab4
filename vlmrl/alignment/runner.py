"""`compare --backends X,Y`: run the same validation on two backends and write one artifact each.

Both sides get the same config, the same requests (built once, so the same images, resized once, and the same prompt
ids), the same sampling settings and seeds; only `rollout.name` differs. Backends run one after the other, each
closed before the next starts, so two engines never compete for memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from vlmrl.alignment.artifact import (
    ArtifactMeta,
    DatasetIdentity,
    engine_info,
    file_fingerprint,
    records_from_rollout,
    write_artifact,
)

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 5
"""Top-k logprobs per generated token: what tells a near-tie from a real divergence."""


def run_backends(backends: list[str], overrides: list[str], out_dir: Path) -> list[Path]:
    """Validate with each backend under the same config; returns the artifact paths (out_dir/val_<backend>.jsonl).
    Config problems raise `UsageError` (exit 2) with the config's own message."""
    from vlmrl.alignment.compare import UsageError
    from vlmrl.config import ROLLOUT_BACKENDS, ConfigError, load_config

    unknown = [name for name in backends if name not in ROLLOUT_BACKENDS]
    if unknown:
        raise UsageError(f"unknown backend(s) {unknown}; choose two of {list(ROLLOUT_BACKENDS)}")
    configs = []
    for backend in backends:
        try:
            configs.append(load_config([*overrides, "trainer.val_only=true", f"rollout.name={backend}"]))
        except ConfigError as err:
            raise UsageError(str(err)) from None
    paths = []
    for backend, config in zip(backends, configs):
        path = out_dir / f"val_{backend}.jsonl"
        started = time.perf_counter()
        logger.info("validating with %s -> %s", backend, path)
        validate_to_artifact(config, path)
        logger.info("%s done in %.1f s", backend, time.perf_counter() - started)
        paths.append(path)
    return paths


def _processor_config(config):
    from vlmrl.processors import ProcessorConfig

    d = config.data
    return ProcessorConfig(min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_prompt_length=d.max_prompt_length,
                           on_overlong="filter" if d.filter_overlong_prompts else "error")


def _sampling(config):
    from vlmrl.types import SamplingParams

    r = config.rollout
    return SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k,
                          max_new_tokens=config.data.max_response_length, seed=config.trainer.seed,
                          top_logprobs=TOP_LOGPROBS)


def _backend_options(config) -> dict:
    """Rollout options from the config: the common ones, plus the engine-specific ones its backend takes."""
    from vlmrl.rollout import backend_class

    r = config.rollout
    options = {"dtype": r.dtype, "max_model_len": config.data.max_prompt_length + config.data.max_response_length,
               "timeout_s": r.timeout_s, "seed": config.trainer.seed, "engine_kwargs": dict(r.engine_kwargs)}
    specific = {"gpu_memory_utilization": r.gpu_memory_utilization, "tensor_parallel_size": r.tensor_parallel_size,
                "server_url": r.server_url}
    taken = {f.name for f in dataclasses.fields(backend_class(r.name).options_class)}
    options.update({k: v for k, v in specific.items() if k in taken and (k != "server_url" or v)})
    return options


def validate_to_artifact(config, path: Path) -> Path:
    """One validation pass of `config.rollout.name` over `config.data.val_files`, written as an artifact."""
    from vlmrl.config import to_dict
    from vlmrl.data import build_requests, load_dataset, sequential_batches
    from vlmrl.processors import load_processor
    from vlmrl.rewards import RewardInput, compute_rewards, get_reward_fn
    from vlmrl.rollout import get_backend

    d, backend_name = config.data, config.rollout.name
    dataset = load_dataset(d.val_files, split="val", prompt_key=d.prompt_key, image_key=d.image_key,
                           synthetic_train_size=d.synthetic_train_size, synthetic_val_size=d.synthetic_val_size)
    processor = load_processor(config.actor.model_path, _processor_config(config))
    built = build_requests(processor, dataset, range(len(dataset)))
    requests = built.requests
    logger.info("%d validation requests from %s (%d rows filtered)", len(requests), dataset.spec, built.num_skipped)
    reward_fn = get_reward_fn(config.reward.function or "auto", dataset.data_sources())
    sampling = _sampling(config)
    results = []
    with get_backend(backend_name, config.actor.model_path, **_backend_options(config)) as backend:
        for batch in sequential_batches(len(requests), d.val_batch_size):
            results.extend(backend.generate([requests[i] for i in batch], sampling))
    by_uid = {request.uid: request for request in requests}
    items = [RewardInput(data_source=by_uid[r.uid].data_source,
                         response=processor.tokenizer.decode(r.response_ids, skip_special_tokens=True),
                         ground_truth=by_uid[r.uid].ground_truth, extra_info=by_uid[r.uid].extra_info)
             for r in results]
    scores, extras, failures = compute_rewards(reward_fn, items)
    if failures:
        logger.warning("%s: the reward function failed on %d of %d samples (scored 0, flagged)", backend_name,
                       failures, len(items))
    engine, version = engine_info(backend_name)
    meta = ArtifactMeta(
        backend=backend_name, engine=engine, engine_version=version, model_path=config.actor.model_path,
        dataset=DatasetIdentity(paths=[str(f) for f in dataset.files], rows=len(dataset),
                                fingerprint=file_fingerprint(dataset.files)),
        sampling=dataclasses.asdict(sampling), config=to_dict(config), step=0,
    )
    records = records_from_rollout(requests, results, scores, processor, reward_extras=extras)
    return write_artifact(path, meta, records)
