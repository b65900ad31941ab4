"""What examples/qwen2_5_vl_grpo.sh asks Python: which recipe a model takes, and the finished run's curve.

    python examples/recipe.py pick MODEL_PATH DEVICES   # prints: demo|<family>_geo3k ENGINE OUTPUT_DIR
    python examples/recipe.py curve ARG ...             # validation accuracy by step, from the run's metrics.jsonl
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vlmrl


def pick(model: str, devices: str) -> str:
    """The demo for no model, an embedded one or a checkpoint the demo wrote (unless devices are asked for), else
    the geo3k recipe of the model's family (`ModelFamily.recipe_for`: a Qwen2.5-VL named 32B or 72B takes the 32B
    recipe), the family known by its config.json, or by a hub id's name (`family_for_hub_id`). The demo's engine is
    vllm when installed, else hf; another embedded model's demo writes beside the default's, not resuming it."""
    from vlmrl.models.tiny import is_embedded

    state = Path(model, "trainer_state.json")
    wrote_demo = bool(model) and state.is_file() and str(
        json.loads(state.read_text()).get("config", {}).get("data", {}).get("train_files", "")).startswith("synthetic")
    if not devices and (not model or is_embedded(model) or wrote_demo):
        engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
        return f"demo {engine} outputs/demo" + (f"-{model}" if model not in ("", "tiny") and not wrote_demo else "")
    from vlmrl.models.families import QWEN2_5_VL, family_for_hub_id, family_for_path

    if model and (Path(model).expanduser() / "config.json").exists():
        family = family_for_path(Path(model).expanduser())
    else:  # a hub id (downloaded later) names its family; another hub id, or none: the default Qwen2.5-VL
        family = family_for_hub_id(model) or QWEN2_5_VL
    recipe = family.recipe_for(model)
    return f"{recipe} vllm outputs/{recipe}"


def curve(args: list[str]) -> str:
    """The run's validation accuracy by step and its rise from step 0, then the files it wrote."""
    from vlmrl.config import load_config
    from vlmrl.trainer.metrics import read_metrics

    out = Path(load_config(args, check_model=False).trainer.output_dir)
    points = [(r["step"], r["val/accuracy"]) for r in read_metrics(out / "metrics.jsonl") if "val/accuracy" in r]
    lines = []
    if points:
        lines.append("val/accuracy by step: " + ", ".join(f"{s}: {a:.2f}" for s, a in points))
        if len(points) > 1:
            rise, best = points[-1][1] - points[0][1], max(a for _, a in points) - points[0][1]
            lines.append(f"rise from step 0: {rise:+.2f} (best {best:+.2f})")
    extra = [str(out / name) for name in ("curves.png", "checkpoints/latest", "engine.log") if (out / name).exists()]
    lines.append(f"outputs: {out}/metrics.jsonl" + "".join(f", {path}" for path in extra))
    return "\n".join(lines)


if __name__ == "__main__":
    print(pick(*sys.argv[2:4]) if sys.argv[1] == "pick" else curve(sys.argv[2:]))
