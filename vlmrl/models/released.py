"""The config.json of a model without downloading its weights: what the memory plan reads to size a model.

A model's shapes come from its config.json: an embedded model's (built locally), a local folder's, a hub id's copy
in the Hugging Face cache when it was downloaded, or else one of the released configs vlmrl ships for the models its
recipes name (`released_configs/`, one file per hub id, `/` written `--`; where each came from: the README there).
No network is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.models.tiny import ensure_built, is_embedded, is_hub_id

RELEASED_CONFIGS = Path(__file__).parent / "released_configs"
"""config.json of released models, named `<org>--<name>.json` after their hub id."""


def released_models() -> list[str]:
    """The hub ids whose config.json vlmrl ships."""
    return sorted(path.stem.replace("--", "/", 1) for path in RELEASED_CONFIGS.glob("*.json"))


def model_config(model_path: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it was read) for an embedded name, a local folder, or a hub id (its cached
    download, else the released config vlmrl ships). FileNotFoundError says what was looked for."""
    if is_embedded(model_path):
        path = ensure_built(model_path) / "config.json"
        return json.loads(path.read_text()), str(path)
    folder = Path(model_path).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no config.json: is it a Hugging Face model folder?")
        return json.loads(path.read_text()), str(path)
    if not is_hub_id(model_path):
        raise FileNotFoundError(f"model {model_path!r}: no such folder (nor an embedded name like `tiny`, or a hub id "
                                "like Qwen/Qwen2.5-VL-7B-Instruct)")
    cached = _cached_hub_config(model_path)
    if cached is not None:
        return json.loads(Path(cached).read_text()), cached
    shipped = RELEASED_CONFIGS / f"{model_path.replace('/', '--', 1)}.json"
    if shipped.exists():
        return json.loads(shipped.read_text()), str(shipped)
    raise FileNotFoundError(f"model {model_path!r}: not downloaded (no config.json in the Hugging Face cache) and not "
                            f"one of the released configs vlmrl ships ({', '.join(released_models())}); download its "
                            f"config (`huggingface-cli download {model_path} config.json`) or give a local folder")


def config_object(raw: dict[str, Any]) -> Any:
    """The transformers config of a config.json dict: the config class its model type names, built from it (what
    `AutoModelForImageTextToText.from_config` takes, e.g. on the meta device, without a folder to read)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)


def _cached_hub_config(repo_id: str) -> str | None:
    """The cached config.json of a hub repository, None when it was never downloaded (no network is used)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return found if isinstance(found, str) else None
