"""Level 1 of a comparison: every way two records' model inputs differ (prompt ids, images, videos), in words."""

from __future__ import annotations

from vlmrl.alignment.artifact import ValidationRecord


def first_difference(a: list, b: list) -> int | None:
    """First index where the lists differ (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diff_inputs(a: ValidationRecord, b: ValidationRecord) -> list[str]:
    """Level 1: every way the model's inputs differ, in words (empty when identical)."""
    out = []
    pos = first_difference(a.prompt_ids, b.prompt_ids)
    if pos is not None:
        out.append(f"prompt ids differ from position {pos} (lengths {len(a.prompt_ids)} vs {len(b.prompt_ids)})")
    if a.expanded_prompt_length != b.expanded_prompt_length:
        out.append(f"expanded prompt length {a.expanded_prompt_length} vs {b.expanded_prompt_length}")
    if len(a.image_hashes) != len(b.image_hashes):
        out.append(f"{len(a.image_hashes)} vs {len(b.image_hashes)} images")
    for i, (ha, hb) in enumerate(zip(a.image_hashes, b.image_hashes)):
        if ha != hb:
            out.append(f"image {i} bytes differ (sha256 {ha[:10]} vs {hb[:10]})")
    for i, (sa, sb) in enumerate(zip(a.image_sizes, b.image_sizes)):
        if list(sa) != list(sb):
            out.append(f"image {i} resized to {sa[0]}x{sa[1]} vs {sb[0]}x{sb[1]}")
    for i, (ga, gb) in enumerate(zip(a.image_grid_thw, b.image_grid_thw)):
        if list(ga) != list(gb):
            out.append(f"image {i} grid_thw {list(ga)} vs {list(gb)}")
    return out + diff_videos(a.videos, b.videos)


VIDEO_FACTS = ("num_frames", "fps", "sample_fps", "frame_indices", "size", "grid_thw")
"""Video facts compared one by one (then the frames' pixels): another frame sampling or fps on one side is an input
mismatch, not a model difference (the temporal position ids follow the sampled fps)."""


def diff_videos(a: list[dict], b: list[dict]) -> list[str]:
    """Every way two records' videos differ, in words: count, the facts in VIDEO_FACTS, then frame pixels.

    >>> diff_videos([{"fps": 2.0, "frame_hashes": ["x"]}], [{"fps": 24.0, "frame_hashes": ["x"]}])
    ['video 0 fps 2.0 vs 24.0']
    """
    out = [f"{len(a)} vs {len(b)} videos"] if len(a) != len(b) else []
    for i, (va, vb) in enumerate(zip(a, b)):
        out += [f"video {i} {key} {va.get(key)} vs {vb.get(key)}" for key in VIDEO_FACTS if va.get(key) != vb.get(key)]
        frames = [j for j, (x, y) in enumerate(zip(va.get("frame_hashes", []), vb.get("frame_hashes", []))) if x != y]
        if frames:
            out.append(f"video {i} frames {frames[:5]} differ in pixels")
    return out
