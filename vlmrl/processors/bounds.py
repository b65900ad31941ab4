"""The run's pixel bounds (data.min_pixels / max_pixels, data.video_min_pixels / video_max_pixels) against the model's
own processor: one rule, used by the processor as it loads and by the config check before anything starts
(`vlmrl.config.check_model_context`), so a bound the model refuses is one `error:` line of the config, not a
traceback from inside the run. Torch-free: the config check reads the model's processor config from its folder.

The bounds must lie within the model's: the engines run the model's processor on vlmrl's resized images and frames,
and would resize them again otherwise (the trainer and the engines would then count different tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmrl.data.config import DataConfig, max_image_pixels_problem


def image_bounds(config: DataConfig, size: Mapping[str, Any], copies: int = 1) -> tuple[int, int]:
    """(min_pixels, max_pixels) of one image: the config's, null = the model's image processor's (`size`:
    shortest_edge / longest_edge, which count `copies` copies of an image: GLM-4.1V's 2). Raises ValueError saying
    what to change where they leave the model's bounds, or where data.max_image_pixels refuses images they allow.

    >>> image_bounds(DataConfig(max_pixels=6272), {"shortest_edge": 3136, "longest_edge": 12544})
    (3136, 6272)
    """
    model_min, model_max = int(size["shortest_edge"]) // copies, int(size["longest_edge"]) // copies
    low = config.min_pixels if config.min_pixels is not None else model_min
    high = config.max_pixels if config.max_pixels is not None else model_max
    if not model_min <= low <= high <= model_max:
        raise ValueError(
            f"data.min_pixels={low}, data.max_pixels={high} must lie within the model's image processor bounds "
            f"[{model_min}, {model_max}] (preprocessor size shortest_edge/longest_edge"
            f"{f' / {copies}, the copies of an image they count' if copies > 1 else ''}); the engines would resize "
            "the images again. Change data.min_pixels/max_pixels (null = the model's) or the model's processor config."
        )
    if config.max_image_pixels < high:  # the model's bound, when data.max_pixels is null
        raise ValueError(max_image_pixels_problem(config.max_image_pixels, high))
    return low, high


def video_frame_bounds(config: DataConfig, size: Mapping[str, Any]) -> tuple[int, int]:
    """(min, max) pixels of one frame where the model's video processor bounds each frame (`size`, Qwen2/2.5-VL):
    the config's, null = the model's. Raises ValueError where they leave the model's bounds."""
    model_min, model_max = int(size["shortest_edge"]), int(size["longest_edge"])
    low = config.video_min_pixels if config.video_min_pixels is not None else model_min
    high = config.video_max_pixels if config.video_max_pixels is not None else model_max
    if not model_min <= low <= high <= model_max:
        raise ValueError(f"data.video_min_pixels={low}, data.video_max_pixels={high} must lie within the model's "
                         f"video processor bounds [{model_min}, {model_max}]; the engines would resize the frames "
                         "again. Change data.video_min_pixels/video_max_pixels (null = the model's).")
    return low, high


def tiles_bounds_problem(config: DataConfig, family_name: str) -> str | None:
    """What is wrong with the image bounds of a tiles family (InternVL): it takes none."""
    if config.min_pixels is None and config.max_pixels is None:
        return None
    return (f"data.min_pixels / data.max_pixels do not apply to {family_name}: its image processor tiles each image "
            "at the model's tile size (every backend runs the same one); leave them null and bound images with "
            "data.max_image_pixels")


def model_bound_problems(config: DataConfig, model_dir: str | Path) -> list[str]:
    """What the model in `model_dir` (a local folder) refuses in the config's image and video bounds, read from its
    processor config files; empty when they fit, or when the folder names no bounds to check them against (the
    processor checks again as it loads, with transformers' defaults)."""
    from vlmrl.models.families import family_for_path

    try:
        family = family_for_path(model_dir)
    except ValueError:  # an unsupported model: load_processor names it
        return []
    image, video = _processor_sizes(Path(model_dir))
    checks = []
    if family.inputs.image_layout == "tiles":
        problem = tiles_bounds_problem(config, family.name)
        return [problem] if problem else []
    if image is not None:
        checks.append(lambda: image_bounds(config, image, family.inputs.image_bound_copies))
    if video is not None and family.inputs.video_timing is not None and not family.inputs.video_bounds_per_video:
        checks.append(lambda: video_frame_bounds(config, video))
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as err:
            problems.append(str(err))
    return problems


def _processor_sizes(folder: Path) -> tuple[dict | None, dict | None]:
    """The image and video processors' size bounds ({shortest_edge, longest_edge}) a model folder's processor
    config files name (processor_config.json's sections, or preprocessor_config.json and
    video_preprocessor_config.json; older Qwen2.5-VL files name min_pixels / max_pixels), None where none."""
    sections: dict[str, dict] = {}
    for name, key in (("processor_config.json", None), ("preprocessor_config.json", "image_processor"),
                      ("video_preprocessor_config.json", "video_processor")):
        if (folder / name).exists():
            data = json.loads((folder / name).read_text())
            for section in ("image_processor", "video_processor"):
                if key is None and isinstance(data.get(section), dict):
                    sections.setdefault(section, data[section])
            if key is not None:
                sections.setdefault(key, data)
    return _size(sections.get("image_processor")), _size(sections.get("video_processor"))


def _size(processor: dict | None) -> dict | None:
    """{shortest_edge, longest_edge} of one processor section: min_pixels / max_pixels override `size`, as
    transformers' Qwen2-VL processors read them; None where a bound is missing (transformers' default applies)."""
    if not processor:
        return None
    size = processor.get("size") or {}
    low = processor.get("min_pixels") or size.get("shortest_edge")
    high = processor.get("max_pixels") or size.get("longest_edge")
    return {"shortest_edge": int(low), "longest_edge": int(high)} if low and high else None
