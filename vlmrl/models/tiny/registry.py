"""The embedded models by name: which family builds a name (the families' `tiny_variants`), the cached build of a
name, and model-path resolution (an embedded name, a local folder, a hub id).

A build is cached under `<cache>/models/<name>-<fingerprint>`: the fingerprint covers the builder version, the
variant's spec, torch and transformers versions, the committed tokenizer files and what the family's builder writes
beyond its spec (`BUILD_FACTS`: GLM-4.1V's and InternVL's own tokens and templates), so an identical build is
reused and any change builds afresh.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

from vlmrl.models.families import FAMILIES, ModelFamily
from vlmrl.models.tiny.common import ASSETS, BUILDER_VERSION
from vlmrl.utils.paths import cache_root

logger = logging.getLogger(__name__)


def _variant_table() -> dict[str, ModelFamily]:
    table: dict[str, ModelFamily] = {}
    for family in FAMILIES:
        for name in family.tiny_variants:
            if name in table:
                raise ValueError(f"embedded model {name!r} named by both {table[name].name} and {family.name}")
            table[name] = family
    return table


VARIANTS: dict[str, ModelFamily] = _variant_table()
"""Every embedded model's name -> its family (derived from the families' `tiny_variants`)."""


def builder(variant: str) -> ModuleType:
    """The module that builds `variant` (its family's `tiny_builder`: `SPECS` by name, `build(out, spec)`,
    `BUILD_FACTS`), imported on first use."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown embedded model {variant!r}; choose one of {sorted(VARIANTS)}")
    module = importlib.import_module(VARIANTS[variant].tiny_builder)
    if variant not in module.SPECS:
        raise ValueError(f"{VARIANTS[variant].name} names the embedded model {variant!r}, but its builder "
                         f"{module.__name__} has no spec for it (it has {sorted(module.SPECS)})")
    return module


def spec(variant: str):
    """The shapes of an embedded model (its builder's spec dataclass)."""
    return builder(variant).SPECS[variant]


def _fingerprint(variant: str) -> str:
    import torch
    import transformers

    module = builder(variant)
    h = hashlib.sha256()
    h.update(json.dumps([BUILDER_VERSION, asdict(module.SPECS[variant]), torch.__version__.split("+")[0],
                         transformers.__version__]).encode())
    for name in ("vocab.json", "merges.txt"):
        h.update((ASSETS / name).read_bytes())
    if module.BUILD_FACTS is not None:
        h.update(json.dumps(module.BUILD_FACTS).encode())
    return h.hexdigest()[:12]


def is_embedded(name: str) -> bool:
    return name in VARIANTS


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
"""What a hub snapshot fetches: configs, safetensors weights, tokenizer and processor files (no pickled *.bin)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local model folder for `name_or_path`: an embedded name (`tiny`, `tiny-qwen3-vl`, `tiny-qwen3.5`...) built
    once; a local folder as it is; a hub id
    (`Qwen/Qwen2.5-VL-7B-Instruct`) downloaded once into the Hugging Face cache (safetensors only; with
    HF_HUB_OFFLINE=1 the cached copy). Anything else raises FileNotFoundError naming it."""
    name = str(name_or_path)
    if name in VARIANTS:
        return str(ensure_built(name))
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local)
    if is_hub_id(name):
        return hub_snapshot(name)
    raise FileNotFoundError(f"model {name!r}: no such folder (nor an embedded name {sorted(VARIANTS)} or a hub id "
                            "like Qwen/Qwen2.5-VL-7B-Instruct)")


def is_hub_id(name: str) -> bool:
    """`org/name` as the Hugging Face hub spells a repository (not a path: no leading /, . or ~, one slash)."""
    return _HUB_ID.fullmatch(name) is not None


@functools.lru_cache(maxsize=None)
def hub_snapshot(repo_id: str) -> str:
    """The hub repository's snapshot folder, downloaded once (FileNotFoundError saying what to do when it cannot)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated, network: all say the same to the user
        raise FileNotFoundError(f"model {repo_id!r} is not a local folder and could not be fetched from the "
                                f"Hugging Face hub ({type(err).__name__}: {err}); download it first "
                                f"(`huggingface-cli download {repo_id}`) or give a local folder") from err


def ensure_built(variant: str = "tiny") -> Path:
    """Build the variant into the cache unless an identical build is there. Safe under concurrent callers:
    each builds into a temporary folder and renames it into place; a loser of the race keeps the winner's copy."""
    target = cache_root() / "models" / f"{variant}-{_fingerprint(variant)}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=target.parent))
    try:
        logger.info("building embedded model %r into %s", variant, target)
        build(tmp, variant)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build(out_dir: str | os.PathLike, variant: str = "tiny") -> Path:
    """Write the full model folder for `variant` into out_dir (created if needed)."""
    module = builder(variant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module.build(out, module.SPECS[variant])
    return out
