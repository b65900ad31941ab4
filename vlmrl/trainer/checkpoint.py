"""Checkpoints: HF-format weights + processor files (vLLM and SGLang load the folder directly) + trainer state.

OUTPUT_DIR/checkpoints/global_step_N/ holds the model files, trainer_state.pt (optimizer, scheduler, RNG; loaded
with weights_only=True) and trainer_state.json (step, data position, config), plus agent_carried.* (partial rollout)
and adapter/ (LoRA) when used; `latest` links to the newest complete one and works as a model path.
Why the renames: a checkpoint is written into `.tmp-*` and renamed into place only when complete, then `latest` is
replaced atomically, so a kill at any moment leaves the previous checkpoint or the new one, never half of one; resume
takes the highest complete step whatever `latest` says; pruning renames to `.deleting-*` first, and
`tidy_checkpoints` (at start) clears what a killed run left. The layout in full: docs/training.md, "Checkpoint
layout"."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmrl.models.saving import save_model

logger = logging.getLogger(__name__)

STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP, _DELETING = ".tmp-", ".deleting-"
# A step folder moved aside while the same step is saved again: `.tmp-stale-global_step_N-PID`.
_STALE = re.compile(r"^\.tmp-stale-(global_step_\d+)-\d+$")
# Weight files come from save_pretrained; everything else in a model folder (tokenizer, processor, chat template)
# is copied so that the checkpoint is a complete model folder.
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|msgpack|h5)$|\.index\.json$")


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    """Every global RNG the run touches, in types torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value: Any) -> Any:
    # random.setstate needs tuples; a round trip may hand back lists.
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def copy_processor_files(model_path: str, dst: Path) -> None:
    """Tokenizer / processor / chat-template files of the source model into dst (a hub id: via AutoProcessor)."""
    from vlmrl.models.tiny import resolve_model_path

    src = Path(resolve_model_path(model_path))
    if src.is_dir():
        for path in src.iterdir():
            if path.is_file() and not _WEIGHT_FILE.search(path.name):
                shutil.copy2(path, dst / path.name)
        return
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(model_path).save_pretrained(dst)


def save_checkpoint(output_dir: str | os.PathLike, step: int, model: torch.nn.Module, source_model_path: str,
                    trainer_state: dict[str, Any], info: dict[str, Any], keep: int | None,
                    write_extra: Callable[[Path], Any] | None = None) -> Path:
    """Write checkpoint `global_step_{step}` atomically, point `latest` at it, keep the newest `keep`.

    Args:
        model: the HF model (saved by `vlmrl.models.saving.save_model`: safetensors + config, a MoE model's experts
            in the layout transformers, vLLM and SGLang load).
        source_model_path: where the processor files come from (the original model).
        trainer_state: tensors and plain values (optimizer, scheduler, RNG) -> trainer_state.pt.
        info: JSON-able facts (step, data position, config) -> trainer_state.json.
        write_extra: writes more files into the (not yet visible) checkpoint folder it is given, e.g. the agent loop's
            carried groups; they become visible with the rest, all at once.
    """
    root = checkpoints_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}global_step_{step}-", dir=root))
    try:
        copy_processor_files(source_model_path, tmp)
        save_model(model, tmp)  # the experts of a MoE model in the layout the engines load
        torch.save(trainer_state, tmp / STATE_PT)
        (tmp / STATE_JSON).write_text(json.dumps({**info, "step": step}, indent=1, default=str))
        if write_extra is not None:
            write_extra(tmp)
        for path in tmp.rglob("*"):  # durable before it becomes visible (the LoRA adapter/ folder's files too)
            if not path.is_file():
                continue
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():  # the same step saved again (a resumed run): swap, never delete before replacing
            stale = root / f"{_TMP}stale-{final.name}-{os.getpid()}"  # restored by tidy_checkpoints if killed here
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _point_latest(root, final.name)
    _prune(root, keep, final)
    logger.info("checkpoint saved: %s", final)
    return final


def _point_latest(root: Path, name: str) -> None:
    """`latest` -> `name` (a relative symlink: the folder can move), replaced atomically."""
    tmp = root / f"{_TMP}latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    latest = root / LATEST
    if latest.is_dir() and not latest.is_symlink():
        # A copy that followed the link (shutil.copytree, rsync -L, an object store) left a real folder here: it is
        # a duplicate of a global_step_N folder, and a folder cannot be replaced by a link.
        logger.warning("%s is a folder, not our link (copied with links followed?): replacing it by a link to %s",
                       latest, name)
        shutil.rmtree(latest)
    os.replace(tmp, latest)


def _is_complete(path: Path) -> bool:
    return all((path / name).exists() for name in (STATE_JSON, STATE_PT, "config.json"))


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and _is_complete(path):
                found.append((int(match.group(1)), path))
    return sorted(found)


def _delete(path: Path) -> None:
    """Rename aside, then remove: a kill in the middle leaves a `.deleting-*` folder (removed at the next start),
    never a half-deleted `global_step_N` that still looks like a checkpoint."""
    aside = path.with_name(_DELETING + path.name)
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(path, aside)
    shutil.rmtree(aside)


def _prune(root: Path, keep: int | None, newest: Path) -> None:
    for path in root.iterdir():  # leftovers of runs killed mid-save or mid-delete
        stale = _STALE.match(path.name)
        if stale and not (root / stale.group(1)).exists():
            continue  # the only copy of that step (tidy_checkpoints puts it back)
        if path.name.startswith((_TMP, _DELETING)):
            if path.is_symlink():  # a `latest` link that was not yet renamed into place
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
    if keep is None:
        return
    complete = _complete_checkpoints(root)
    for _, path in complete[: max(0, len(complete) - keep)]:
        if path != newest:
            _delete(path)


def tidy_checkpoints(output_dir: str | os.PathLike, keep: int | None) -> None:
    """At the start of a run that may resume: finish what a killed run left half done. A step folder moved aside for a
    re-save goes back if its replacement never arrived; `.tmp-*` (interrupted saves) and `.deleting-*` (interrupted
    deletes) folders go, as do incomplete step folders older than the newest complete one (deleted by an earlier
    version without the rename); then the newest `keep` complete checkpoints stay."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return
    for path in root.iterdir():
        stale = _STALE.match(path.name)
        if stale and not (root / stale.group(1)).exists() and _is_complete(path):
            os.rename(path, root / stale.group(1))
            logger.warning("restored %s, moved aside by a run killed while saving that step again", stale.group(1))
    complete = _complete_checkpoints(root)
    newest = complete[-1][0] if complete else -1
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and int(match.group(1)) < newest and not _is_complete(path):
            logger.warning("removing %s: an incomplete checkpoint older than global_step_%d", path, newest)
            _delete(path)
    _prune(root, keep, complete[-1][1] if complete else root)
    if complete and _pointer(root) != complete[-1][1].name:
        why = _why_latest_moves(root, complete[-1][1].name)
        if why:  # a folder in the link's place is reported by _point_latest itself
            logger.warning("%s named %s; it names %s now, the newest complete checkpoint (%s)", root / LATEST,
                           _pointer(root) or "nothing", complete[-1][1].name, why)
        _point_latest(root, complete[-1][1].name)


def _why_latest_moves(root: Path, newest: str) -> str | None:
    """Why `latest` does not name `newest`, in a user's words; None when a folder stands in the link's place."""
    latest = root / LATEST
    if latest.is_dir() and not latest.is_symlink():
        return None
    named = _pointer(root)
    if named is None:
        return "there was no link: a run killed before it wrote one"
    if not (root / named).is_dir():
        return "the folder it named is gone"
    if not _is_complete(root / named):
        return "the folder it named is incomplete"
    return f"a run killed after saving {newest} and before re-pointing the link"


def refuse_earlier_checkpoints(output_dir: str | os.PathLike) -> None:
    """For a run that must not resume (trainer.resume=false): refuse an output_dir that holds another run's
    checkpoints. Sharing it would mix the two runs' checkpoints (keep-last-K counts steps across both, so it could
    delete the new run's and keep the old ones, and a later resume would pick the wrong run)."""
    complete = _complete_checkpoints(checkpoints_root(output_dir))
    if complete:
        names = ", ".join(path.name for _, path in complete[-3:])
        raise ValueError(f"trainer.resume=false but {checkpoints_root(output_dir)} holds checkpoints of an earlier "
                         f"run ({names}): use a new trainer.output_dir, set trainer.resume=true to continue that "
                         "run, or delete its checkpoints folder")


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (highest complete step), whatever `latest` says; None when there is none."""
    root = checkpoints_root(output_dir)
    complete = _complete_checkpoints(root)
    if not complete:
        return None
    newest = complete[-1][1]
    named = _pointer(root)
    if named != newest.name:
        logger.warning("%s names %s but the newest complete checkpoint is %s (a run killed before the link was "
                       "rewritten); using %s", root / LATEST, named, newest.name, newest.name)
    return newest


def _pointer(root: Path) -> str | None:
    """The folder `latest` names: a symlink, or the text file that earlier versions wrote."""
    pointer = root / LATEST
    if pointer.is_symlink():
        return os.readlink(pointer)
    return pointer.read_text().strip() if pointer.is_file() else None


def load_checkpoint_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer_state.pt contents, trainer_state.json contents) of a checkpoint folder."""
    state = torch.load(path / STATE_PT, map_location="cpu", weights_only=True)
    info = json.loads((path / STATE_JSON).read_text())
    return state, info
