"""The groups partial rollout carries into the next step, written to and read from a folder (a checkpoint).

    agent_carried.json           {"format": 3, "groups": [...]}: each group's request (with its videos' timing) and
                                 trajectories (token ids, logprobs, version tags, per-turn state, counters,
                                 tool-state entries)
    agent_carried.safetensors    every image as bytes (uint8): the request's images once per group, then each
                                 trajectory's tool images; PNG for the modes PNG holds exactly (RGB, RGBA, L, LA, 1),
                                 raw pixel bytes for any other mode; and each request video's sampled frames as one
                                 (T, H, W, 3) uint8 tensor (raw: they are already the sampled, resized frames)

No pickle. An image is stored with its mode and size and rebuilt byte for byte (its sha256 is checked against the
saved hash), so a resumed run gives the engines and the processor exactly the same pixels; a video likewise, with
its timing (source fps, sampled frame indices, total frames: the position ids depend on them), checked against its
saved hash of frames and timing. PNG is lossless; it is written at compression level 1 (a checkpoint waits for it:
~75 ms per 1024x1024 photo) and still stores a photo in about half its raw size, a flat synthetic image in under one
percent. A finished trajectory is stored as its
trajectory; the agent loop pads it again on load (padding is a pure function of it and the processor).
Tool states are entries the loop makes with `Tool.save_state` (see `vlmrl.agent.loop.AgentLoop.save_carried`).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmrl.agent.trajectory import Trajectory
from vlmrl.atomic import replace_atomically, write_text_atomically
from vlmrl.processors.images import image_hash
from vlmrl.processors.video import video_hash
from vlmrl.types import RolloutRequest, Video

CARRIED_JSON = "agent_carried.json"
CARRIED_TENSORS = "agent_carried.safetensors"
FORMAT = 3
"""Version of the files above; a reader refuses a newer one rather than guessing. 1: raw image bytes only
(read as such); 2: each image names its encoding (png or raw); 3: requests carry their videos (a format-2 reader
would drop them silently, so it must refuse)."""

PNG_MODES = frozenset({"1", "L", "LA", "RGB", "RGBA"})
"""Image modes a PNG file stores and Pillow reads back byte for byte."""

TRAJECTORY_FIELDS = ("sample_index", "response_ids", "response_mask", "logprobs", "token_versions",
                     "tool_image_hashes", "expanded_length", "turns", "turn_start", "open_turn", "done",
                     "finish_reason", "end_reason", "tool_rewards", "counters", "assistant_texts", "tool_turns")
"""Trajectory fields stored as JSON as they are (its request, tool images and tool states are stored apart)."""
ADDED_FIELDS = {"tool_turns": list}
"""Fields checkpoints written before them lack: restored empty."""

_TAG = "__vlmrl__"
"""Marks a JSON object that encodes a value JSON has no type for (bytes, a tuple, a numpy array, an odd dict)."""

ToolEntries = dict[str, dict[str, Any]]
"""One trajectory's tool states: {tool name: {"state": json} | {"recreate": true} | {"create_failed": message}}."""


# ---------------------------------------------------------------------------------------------------- writing


def write_carried(directory: Path, groups: Sequence[tuple[RolloutRequest, Sequence[Trajectory]]],
                  tool_entries: dict[str, ToolEntries]) -> None:
    """Write `groups` (request, trajectories) into `directory`; `tool_entries` by trajectory key (unfinished ones).

    Each file is replaced atomically, the JSON last, so a reader never sees a JSON naming missing images.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    records = []
    for g, (request, trajectories) in enumerate(groups):
        record = {"request": _request_record(request, f"g{g}/request", tensors),
                  "trajectories": [_trajectory_record(t, f"g{g}/t{i}", tensors, tool_entries.get(t.key, {}))
                                   for i, t in enumerate(trajectories)]}
        records.append(record)
    replace_atomically(directory / CARRIED_TENSORS, lambda tmp: save_file(tensors, tmp))
    write_text_atomically(directory / CARRIED_JSON, json.dumps({"format": FORMAT, "groups": records}))


def _request_record(request: RolloutRequest, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    where = f"request {request.uid}"
    return {"uid": request.uid, "prompt_ids": list(request.prompt_ids),
            "images": [_put_image(tensors, f"{prefix}/{k}", im) for k, im in enumerate(request.images)],
            "image_hashes": list(request.image_hashes),
            "videos": [_put_video(tensors, f"{prefix}/video{k}", v) for k, v in enumerate(request.videos)],
            "banned_token_ids": list(request.banned_token_ids),
            "data_source": request.data_source, "ground_truth": to_json(request.ground_truth, f"{where} ground_truth"),
            "extra_info": to_json(request.extra_info, f"{where} extra_info"), "index": request.index}


def _trajectory_record(traj: Trajectory, prefix: str, tensors: dict[str, torch.Tensor],
                       tool_entries: ToolEntries) -> dict[str, Any]:
    if len(traj.tool_images) != len(traj.tool_image_hashes):
        raise RuntimeError(f"trajectory {traj.key}: {len(traj.tool_images)} tool images but "
                           f"{len(traj.tool_image_hashes)} hashes")
    record = {name: getattr(traj, name) for name in TRAJECTORY_FIELDS}
    record["tool_images"] = [_put_image(tensors, f"{prefix}/{k}", im) for k, im in enumerate(traj.tool_images)]
    record["tool_states"] = tool_entries
    return record


def _put_image(tensors: dict[str, torch.Tensor], key: str, image: Image.Image) -> dict[str, Any]:
    if image.mode in PNG_MODES:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        data, encoding = buffer.getvalue(), "png"
    else:
        data, encoding = image.tobytes(), "raw"
    tensors[key] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return {"tensor": key, "encoding": encoding, "mode": image.mode, "size": list(image.size)}


def _put_video(tensors: dict[str, torch.Tensor], key: str, video: Video) -> dict[str, Any]:
    tensors[key] = torch.from_numpy(np.ascontiguousarray(video.frames, dtype=np.uint8))
    return {"tensor": key, "fps": video.fps, "frame_indices": [int(i) for i in video.frame_indices],
            "total_frames": int(video.total_frames), "hash": video.hash}


# ---------------------------------------------------------------------------------------------------- reading


def read_carried(directory: Path) -> tuple[list[tuple[RolloutRequest, list[Trajectory]]],
                                           dict[str, ToolEntries]] | None:
    """The groups `write_carried` wrote, with their trajectories' tool-state entries by trajectory key (the tool
    states themselves are left empty: the loop rebuilds them). None when `directory` holds no such files."""
    from safetensors.torch import load_file

    json_path = directory / CARRIED_JSON
    if not json_path.exists():
        return None
    saved = json.loads(json_path.read_text())
    if not isinstance(saved, dict) or not isinstance(saved.get("format"), int):
        raise ValueError(f"{json_path}: not a carried-groups file (no format version)")
    if saved["format"] > FORMAT:
        raise ValueError(f"{json_path}: format {saved['format']} was written by a newer vlmrl; this one reads up to "
                         f"format {FORMAT}: upgrade vlmrl to resume this run")
    tensors = load_file(directory / CARRIED_TENSORS)
    groups, entries = [], {}
    for record in saved["groups"]:
        request = _request_from(record["request"], tensors, json_path)
        trajectories = []
        for item in record["trajectories"]:
            traj = _trajectory_from(item, request, tensors, json_path)
            entries[traj.key] = dict(item["tool_states"])
            trajectories.append(traj)
        groups.append((request, trajectories))
    return groups, entries


def _request_from(record: dict[str, Any], tensors: dict[str, torch.Tensor], source: Path) -> RolloutRequest:
    images = [_get_image(tensors, item, source) for item in record["images"]]
    _check_hashes(images, record["image_hashes"], f"request {record['uid']}", source)
    videos = [_get_video(tensors, item, source) for item in record.get("videos", [])]  # format < 3: none
    return RolloutRequest(uid=record["uid"], prompt_ids=list(record["prompt_ids"]), images=images,
                          image_hashes=list(record["image_hashes"]), banned_token_ids=list(record["banned_token_ids"]),
                          videos=videos,
                          data_source=record["data_source"], ground_truth=from_json(record["ground_truth"]),
                          extra_info=from_json(record["extra_info"]), index=int(record["index"]))


def _trajectory_from(record: dict[str, Any], request: RolloutRequest, tensors: dict[str, torch.Tensor],
                     source: Path) -> Trajectory:
    traj = Trajectory(request, **{name: record[name] if name in record or name not in ADDED_FIELDS
                                  else ADDED_FIELDS[name]() for name in TRAJECTORY_FIELDS})
    traj.tool_images = [_get_image(tensors, item, source) for item in record["tool_images"]]
    _check_hashes(traj.tool_images, traj.tool_image_hashes, f"trajectory {traj.key}", source)
    if not (len(traj.response_ids) == len(traj.response_mask) == len(traj.logprobs) == len(traj.token_versions)):
        raise ValueError(f"{source}: trajectory {traj.key} has token lists of different lengths")
    return traj


def _get_image(tensors: dict[str, torch.Tensor], item: dict[str, Any], source: Path) -> Image.Image:
    data = tensors.get(item["tensor"])
    if data is None:
        raise ValueError(f"{source}: image {item['tensor']!r} is missing from {CARRIED_TENSORS}")
    mode, size, encoding = item["mode"], tuple(item["size"]), item.get("encoding", "raw")  # format 1: raw only
    if encoding == "raw":
        return Image.frombytes(mode, size, data.numpy().tobytes())
    if encoding != "png":
        raise ValueError(f"{source}: image {item['tensor']!r} has an unknown encoding {encoding!r}")
    try:
        image = Image.open(io.BytesIO(data.numpy().tobytes()), formats=["PNG"])
        image.load()
    except (OSError, SyntaxError, ValueError) as error:  # what Pillow raises for a broken PNG
        raise ValueError(f"{source}: image {item['tensor']!r} cannot be decoded ({error}): a damaged checkpoint") \
            from error
    if image.mode != mode or image.size != size:
        raise ValueError(f"{source}: image {item['tensor']!r} decodes to {image.mode} {image.size}, saved as "
                         f"{mode} {size} (a damaged checkpoint)")
    return image


def _get_video(tensors: dict[str, torch.Tensor], item: dict[str, Any], source: Path) -> Video:
    frames = tensors.get(item["tensor"])
    if frames is None:
        raise ValueError(f"{source}: video {item['tensor']!r} is missing from {CARRIED_TENSORS}")
    video = Video(frames=frames.numpy(), fps=float(item["fps"]), frame_indices=list(item["frame_indices"]),
                  total_frames=int(item["total_frames"]), hash=item["hash"])
    if item["hash"] and video_hash(video) != item["hash"]:
        raise ValueError(f"{source}: video {item['tensor']!r} does not match its saved hash (a damaged checkpoint)")
    return video


def _check_hashes(images: list[Image.Image], hashes: list[str], owner: str, source: Path) -> None:
    if [image_hash(im) for im in images] != list(hashes):
        raise ValueError(f"{source}: the images of {owner} do not match their saved hashes (a damaged checkpoint)")


# ---------------------------------------------------------------------------------------------------- JSON values


def to_json(value: Any, where: str) -> Any:
    """`value` as JSON, exactly: bytes, tuples, numpy values and dicts with non-string keys are tagged; anything else
    JSON has no form for raises a TypeError naming `where`.

    >>> to_json({"a": (1, b"x")}, "example")
    {'a': {'__vlmrl__': 'tuple', 'items': [1, {'__vlmrl__': 'bytes', 'base64': 'eA=='}]}}
    >>> from_json(to_json({"a": (1, b"x"), 2: None}, "example"))
    {'a': (1, b'x'), 2: None}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [to_json(v, where) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.ndarray) and value.dtype != object:
        return {_TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "items": to_json(value.tolist(), where)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: to_json(v, where) for k, v in value.items()}
        return {_TAG: "dict", "items": [[to_json(k, where), to_json(v, where)] for k, v in value.items()]}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in a checkpoint (JSON values, bytes, tuples "
                    "and numpy arrays can be stored)")


def from_json(value: Any) -> Any:
    """The inverse of `to_json`."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: from_json(v) for k, v in value.items()}
    if tag == "tuple":
        return tuple(from_json(v) for v in value["items"])
    if tag == "bytes":
        return base64.b64decode(value["base64"])
    if tag == "ndarray":
        return np.array(from_json(value["items"]), dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    if tag == "dict":
        return {from_json(k): from_json(v) for k, v in value["items"]}
    raise ValueError(f"unknown tagged value {tag!r} in a carried-groups file")
