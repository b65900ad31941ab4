"""The trainer side of `python -m vlmrl.alignment.compare`, teacher-forced: it scores another side's tokens.
The policy, built the way a run builds it, scores the other side's sampled tokens through the code path the update
uses. (`vlmrl.alignment.trainer_side` is what compare knows of this side without importing the trainer.)

    python -m vlmrl.trainer.teacher_forcing config=FILE.yaml key=value ... --reference A.jsonl --out B.jsonl

`compare --backends trainer,vllm` (any engine, either order) runs the engine's validate-only pass first, then this
on its artifact, then the usual four-level diff. What the trainer side does, per validation request:
- rebuilds the request from the data with the run's processor (data.*, the same rows in the same order) and keeps its
  own prompt ids, image hashes, sizes and grids in its records: inputs that differ from the engine's are the diff's
  first level (`input_mismatch`);
- takes the engine's response tokens, finish reasons and rewards as they are (so the tokens level agrees by
  construction), pads them per sample and stacks them with padding rows as a training step does
  (`vlmrl.batch.padding.pad_results`, `scored_batch`), and computes their logprobs with `Actor.compute_logprobs`: the
  actor's dtype and compute dtype, padding-free packing, token-budget micro-batches, chunked logprobs and LoRA
  adapters are the run's settings (`actor.*`); a LoRA run's checkpoint is scored as that run trained it, its base
  model with the checkpoint's adapters (`lora_checkpoint`), against the merged weights the engines serve;
- writes raw logprobs (temperature 1, what every engine returns) and, when the validation sampled (T > 0) or the
  engine's header says it returned processed logprobs, also the logprobs of the distribution the engine sampled
  from (`tempered_logprobs`): softmax(logits / T) over the tokens the requests allow (the image/video placeholders
  they ban left out), after top-k and top-p, what vLLM's processed logprobs are. An engine whose logprobs match
  those returned processed logprobs, which the diff names (`processed_logprobs`). Measured on the demo's tiny model
  at T = 0.7: vLLM's processed logprobs sit within 3e-6 nats of these, and 2e-4 to 7e-3 nats above softmax(logits
  / T) over the whole vocabulary (the ban's renormalisation: the placeholders held that much mass).

At trainer.n_gpus_per_node x trainer.nnodes > 1 the scorer is the run's FSDP2-sharded actor on that many Ray
workers (`scoring_actor`): each rank scores its slice of every batch's rows (padding rows up to a multiple of the
world size, as a step pads) and the driver gathers them, the path a sharded run's old logprobs take; the sampled
distribution's logprobs are left out there (they hook the head of one unsharded model; compare then reads the engine
header's `logprobs_mode`). The drill-down hooks one unsharded model, so it needs one device. agent.enable must be
false (a multi-turn trajectory's inputs are rebuilt turn by turn, which this side does not do yet). Both are refused
before anything loads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrl.alignment.artifact import (
    ArtifactError,
    ArtifactMeta,
    DatasetIdentity,
    ValidationRecord,
    engine_info,
    file_fingerprint,
    read_artifact,
    records_from_rollout,
    weights_fingerprint,
    write_artifact,
)
from vlmrl.alignment.trainer_side import TRAINER, TrainerSideError, check_config
from vlmrl.config import Config, ConfigError, load_config, to_dict

if TYPE_CHECKING:  # torch loads only once the config is valid
    import torch

logger = logging.getLogger(__name__)


def _reference_results(records: list[ValidationRecord], requests, n: int, path: Path):
    """The engine's samples as RolloutResults, request-major in the trainer's request order, with their rewards."""
    from vlmrl.types import RolloutResult

    by_key = {(r.index, r.sample_index): r for r in records}
    wanted = {(request.index, k) for request in requests for k in range(n)}
    extra = sorted(set(by_key) - wanted)
    if extra:
        raise TrainerSideError(f"{path}: rows {sorted({i for i, _ in extra})[:8]} are not in this config's validation "
                               "set (other data, max_prompt_length or rollout.val_n than the reference run)")
    results, rewards, parts = [], [], []
    for request in requests:
        for k in range(n):
            record = by_key.get((request.index, k))
            if record is None:
                raise TrainerSideError(f"{path}: no sample {k} of validation row {request.index} (the reference run "
                                       "validated other rows or fewer samples per row)")
            results.append(RolloutResult(request.uid, k, list(record.response_ids), list(record.response_logprobs),
                                         record.finish_reason))
            rewards.append(record.reward)
            parts.append(dict(record.reward_extra))
    return results, rewards, parts


def score_reference(config: Config, reference: str | Path, out: str | Path, drill: bool = False) -> Path:
    """Score the reference artifact's samples with the trainer built from `config`; write the trainer side's
    artifact to `out` and return its path. `drill`: also compare the trainer's policy module by module with
    transformers on the engine side's weights, on the sample where the two sides' logprobs differ most
    (`vlmrl.alignment.drill_down`), into the header's `drill_down`."""
    from vlmrl.trainer.components import load_run_processor
    from vlmrl.trainer.validation import build_validation_requests, load_val_dataset

    check_config(config, drill=drill)
    reference = Path(reference)
    try:
        meta, records = read_artifact(reference)
    except ArtifactError as err:
        raise TrainerSideError(str(err)) from None
    if meta.backend == TRAINER:
        raise TrainerSideError(f"{reference} is a trainer side's artifact: score an engine's")
    n = int(meta.sampling.get("n", 1))
    try:
        processor = load_run_processor(config)
    except ValueError as err:  # the data section against the model's processor (pixel bounds...): the user's to fix
        raise TrainerSideError(f"the processor of {config.actor.model_path}: {err}") from None
    dataset = load_val_dataset(config)
    identity = DatasetIdentity(paths=[str(f) for f in dataset.files], rows=len(dataset),
                               fingerprint=file_fingerprint(dataset.files))
    if (identity.fingerprint, identity.rows) != (meta.dataset.fingerprint, meta.dataset.rows):
        raise TrainerSideError(f"{reference} validated other data ({meta.dataset.paths}, {meta.dataset.rows} rows) "
                               f"than this config's ({identity.paths}, {identity.rows} rows): give the trainer side "
                               "the engine side's data.* settings")
    calls = build_validation_requests(config, processor, dataset).calls
    requests = [request for call in calls for request in call]
    results, rewards, parts = _reference_results(records, requests, n, reference)
    actor_config, init_path = lora_checkpoint(config)
    world = config.derived.world_size
    actor = scoring_actor(config, actor_config, init_path)
    try:
        out_records, batches, scored = _score(actor, config, processor, calls, requests, results, rewards, parts, n,
                                              meta.sampling, meta.logprobs_mode.startswith("processed"))
        dtype = str(actor.forward_dtype()).removeprefix("torch.")  # the dtype the scores were computed in
        drilled = {}
        if drill:
            index_of = {request.uid: request.index for request in requests}
            drilled = _drill_down(actor, meta, records, scored, batches, index_of).to_dict()
    finally:
        if world > 1:
            actor.close()
    engine, version = engine_info(TRAINER)
    out_meta = ArtifactMeta(backend=TRAINER, engine=engine, engine_version=version,
                            model_path=config.actor.model_path, dataset=identity, sampling=dict(meta.sampling),
                            config=to_dict(config), step=meta.step, dtype=dtype, logprobs_mode="raw_logprobs",
                            weights=weights_fingerprint(config.actor.model_path), drill_down=drilled)
    path = write_artifact(out, out_meta, out_records)
    logger.info("trainer side: %d samples of %s scored teacher-forced (%s, %d rank%s) -> %s", len(out_records),
                reference, dtype, world, "" if world == 1 else "s", path)
    return path


def scoring_actor(config: Config, actor_config, init_path: str | None):
    """The actor a run of `config` trains with: the single-process `Actor` on one device, else the FSDP2-sharded
    `DistributedActor` over trainer.n_gpus_per_node x trainer.nnodes Ray workers (without engines), whose
    compute_logprobs splits the batch's rows over the ranks and gathers them back, as the update's does."""
    from vlmrl.actor.local import Actor

    if config.derived.world_size == 1:
        return Actor(actor_config, total_steps=1, mini_batch_samples=config.derived.mini_batch_samples,
                     temperature=1.0, init_path=init_path)
    from vlmrl.distributed.group import DistributedActor
    from vlmrl.distributed.worker import WorkerSpec
    from vlmrl.trainer.components import run_cluster

    spec = WorkerSpec(actor=actor_config, temperature=1.0, init_path=init_path, total_steps=1, engine=None,
                      torch_threads=config.trainer.torch_threads, timeout_s=config.rollout.timeout_s)
    return DistributedActor(run_cluster(config), spec, mini_batch_samples=config.derived.mini_batch_samples,
                            timeout_s=config.rollout.timeout_s, startup_timeout_s=config.rollout.start_timeout_s)


def _score(actor, config: Config, processor, calls, requests, results, rewards, parts, n: int, sampling: dict,
           processed: bool):
    """Each validation call's samples padded and stacked as a training step does (padding rows up to a multiple of
    the world size), scored at temperature 1, and under the distribution the engine sampled from where that is asked
    for (`sampled_distribution`; `processed`: the engine's header says it returned processed logprobs; one device
    only). Returns (records, (batch, first sample's position) per call, the scored results)."""
    import torch

    from vlmrl.alignment.routing import encode_routing
    from vlmrl.batch.padding import pad_results, scored_batch
    from vlmrl.types import RolloutResult

    d = config.data
    world = config.derived.world_size
    sampled = sampled_distribution(sampling, processed)
    if sampled is not None and world > 1:
        logger.info("trainer side: the sampled distribution's logprobs are computed on one device; at world size %d "
                    "none are recorded", world)
        sampled = None
    scored: list[RolloutResult] = []
    tempered: list[list[float] | None] = []
    routes: list = []  # a MoE policy's routing of each scored sample (one process), for compare's `routing` cause
    record_routing = getattr(actor, "routing", None) is not None
    batches = []  # (batch, first sample's position) per call, for the drill-down
    start = 0
    for call in calls:
        rows = results[start:start + len(call) * n]
        samples = pad_results([processor.prompt_inputs(r) for r in call], rows, prompt_length=d.max_prompt_length,
                              response_length=d.max_response_length, pad_token_id=processor.pad_token_id,
                              policy_version=0)
        batch = scored_batch(samples, rewards[start:start + len(rows)], parts[start:start + len(rows)],
                             multiple=world, eos_token_id=processor.eos_token_ids[0],
                             pad_token_id=processor.pad_token_id)
        actor.set_temperature(1.0)
        with torch.no_grad():
            raw = actor.compute_logprobs(batch, record_routing=record_routing)[0]
        hot = None
        if sampled is not None:
            with torch.no_grad(), _sampler_head(actor, processor.banned_token_ids, *sampled):
                hot = actor.compute_logprobs(batch)[0]
        batches.append((batch, start))
        for i, result in enumerate(rows):
            length = len(result.response_ids)
            scored.append(replace(result, response_logprobs=raw[i, :length].double().tolist()))
            tempered.append(None if hot is None else hot[i, :length].double().tolist())
            routes.append(batch.routed_experts[i] if record_routing else None)
        start += len(rows)
    out_records = records_from_rollout(requests, scored, rewards, processor, parts)
    for record, values, routing in zip(out_records, tempered, routes):
        record.tempered_logprobs = values
        record.routing = None if routing is None else encode_routing(routing)
    return out_records, batches, scored


def sampled_distribution(sampling: dict, processed: bool = False) -> tuple[float, int, float] | None:
    """(temperature, top_k, top_p) of the distribution an engine sampled from under these sampling settings (an
    artifact header's `sampling`), when its logprobs are worth computing: the validation sampled (T > 0), or the
    engine says it returned processed logprobs (`processed`; greedy: vLLM's are then the raw ones renormalised after
    the ban, no temperature, top-k or top-p). None otherwise: greedy raw logprobs are compared as they are.

    >>> sampled_distribution({"temperature": 0.7, "top_k": -1, "top_p": 1.0})
    (0.7, 0, 1.0)
    >>> sampled_distribution({"temperature": 0.0, "top_p": 0.9}), sampled_distribution({"temperature": 0.0}, True)
    (None, (1.0, 0, 1.0))
    """
    temperature = float(sampling.get("temperature", 0.0))
    if temperature == 0.0:
        return (1.0, 0, 1.0) if processed else None
    return temperature, max(int(sampling.get("top_k", -1)), 0), float(sampling.get("top_p", 1.0))


def sampler_mask(logits: torch.Tensor, banned: Sequence[int], temperature: float, top_k: int, top_p: float
                 ) -> torch.Tensor:
    """(..., V) logits with every token the engine's sampler cannot draw at -inf, in vLLM's order and by its rules:
    the banned ids (its `bad_words`), then on logits / temperature the tokens below the k-th largest (`top_k` > 0)
    and those whose probability mass from the bottom of the ranking up, themselves included, is at most 1 - top_p
    (the most likely token always stays). The temperature itself is left to the caller.

    >>> import torch
    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> sampler_mask(logits, [0], 1.0, 0, 1.0).tolist()
    [[-inf, 1.0, 0.0, -1.0]]
    >>> sampler_mask(logits, [], 1.0, 2, 1.0).tolist(), sampler_mask(logits, [], 1.0, 0, 0.5).tolist()
    ([[2.0, 1.0, -inf, -inf]], [[2.0, -inf, -inf, -inf]])
    """
    import torch

    out = logits.clone()
    out[..., list(banned)] = float("-inf")
    if top_k <= 0 and top_p >= 1.0:
        return out
    ranked, order = (out.float() / temperature).sort(dim=-1)  # ascending, as vLLM's apply_top_k_top_p
    drop = torch.zeros_like(ranked, dtype=torch.bool)
    if 0 < top_k < ranked.shape[-1]:
        drop |= ranked < ranked[..., -top_k:-top_k + 1 or None]
    if top_p < 1.0:
        below = ranked.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        below[..., -1] = False
        drop |= below
    return out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


@contextmanager
def _sampler_head(actor, banned: Sequence[int], temperature: float, top_k: int, top_p: float):
    """The actor at `temperature` with `sampler_mask` on its output projection's logits for the block (a forward
    hook, which the logprob pass's own head, wrapped around that projection, runs): that pass then scores the
    distribution the engine sampled from. Temperature 1 and the plain head come back however the block ends."""
    actor.set_temperature(temperature)
    hook = actor.model.get_output_embeddings().register_forward_hook(
        lambda _module, _inputs, logits: sampler_mask(logits, banned, temperature, top_k, top_p))
    try:
        yield
    finally:
        hook.remove()
        actor.set_temperature(1.0)


def lora_checkpoint(config: Config):
    """(actor config, init_path) the trainer side builds the actor with. With actor.lora on and actor.model_path a
    LoRA run's checkpoint (its merged weights beside an adapter/ folder), the policy is what that run trained: its
    base model (the run's actor.model_path, from trainer_state.json) with the checkpoint's adapters, not the merged
    weights the engines load; so the diff compares adapter against merged. Otherwise the config's actor as it is."""
    import json

    from vlmrl.actor.lora import ADAPTER_DIR

    folder = Path(config.actor.model_path)
    if not (config.actor.lora.enabled and (folder / ADAPTER_DIR).is_dir()):
        return config.actor, None
    try:
        base = json.loads((folder / "trainer_state.json").read_text())["config"]["actor"]["model_path"]
    except (OSError, KeyError, ValueError) as err:
        raise TrainerSideError(f"{folder} holds a LoRA adapter but no readable trainer_state.json naming its base "
                               f"model ({err}); set actor.lora.rank=0 to score the merged weights") from None
    logger.info("trainer side: LoRA checkpoint %s: base %s with the checkpoint's adapters", folder, base)
    return replace(config.actor, model_path=base), str(folder)


def _drill_down(actor, meta: ArtifactMeta, records: list[ValidationRecord], scored, batches, index_of):
    """The drill-down on the sample whose trainer and engine logprobs differ most (ties: the first). `scored`: the
    trainer's results in batch order, `batches`: (batch, position of its first sample), `index_of`: uid -> row."""
    import torch

    from vlmrl.actor.policy import load_policy, resolve_dtype
    from vlmrl.alignment.drill_down import BFLOAT16_TOLERANCE, FLOAT32_TOLERANCE, drill_down
    from vlmrl.alignment.precision import side_dtype
    from vlmrl.models.families import family_of

    engine = {(r.index, r.sample_index): r.response_logprobs for r in records}
    gaps = [max((abs(a - b) for a, b in zip(s.response_logprobs, engine[(index_of[s.uid], s.sample_index)])),
                default=0.0) for s in scored]
    worst = max(range(len(scored)), key=lambda i: gaps[i])
    batch, first = next((b, f) for b, f in reversed(batches) if f <= worst)
    engine_dtype = resolve_dtype(side_dtype(meta) or "auto", actor.device)
    reference = load_policy(meta.model_path, engine_dtype, actor.device).eval()
    trainer_dtype = actor.forward_dtype()
    both32 = torch.float32 in (engine_dtype, torch.float64) and trainer_dtype in (torch.float32, torch.float64)
    result = drill_down(actor, reference, batch, worst - first, family=family_of(reference.config),
                        index=index_of[scored[worst].uid], sample_index=scored[worst].sample_index,
                        tolerance=FLOAT32_TOLERANCE if both32 else BFLOAT16_TOLERANCE)
    logger.info("drill-down on row %d #%d (max |dlogp| %.3g): first module beyond tolerance: %s", result.index,
                result.sample_index, gaps[worst], result.first)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmrl.trainer.teacher_forcing", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config=FILE.yaml and dotted overrides")
    parser.add_argument("--reference", required=True, help="the engine side's artifact whose samples are scored")
    parser.add_argument("--out", required=True, help="where the trainer side's artifact is written")
    parser.add_argument("--drill-down", action="store_true", help="also name the first module whose output differs "
                        "from transformers' (on the engine side's weights) on the worst sample")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        config = load_config(list(args.overrides))
        check_config(config, drill=args.drill_down)
        score_reference(config, args.reference, args.out, drill=args.drill_down)
    except (ConfigError, TrainerSideError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

