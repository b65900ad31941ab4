"""The weights probe: does the engine hold the trainer's weights right now?

Counting weight loads (`RolloutBackend.weight_loads`) tells a sync that never reached the engine; it cannot tell one
that reached it and landed partly (a bucket lost, a layer's tensors mapped to nothing, a stale cache in front of the
new weights). The probe reads what the engine computes instead. After every weight sync (and once before the first
step) the fit loop sends the engine one fixed request, the first training row, greedy for `trainer.weight_probe_tokens`
tokens with their logprobs, and the trainer scores the same tokens teacher-forced with its current weights at
temperature 1 (the engine's logprobs are raw). This module judges the two (`judge`); it needs no torch.

Two numbers decide:
- the gap, max |engine - trainer| over the probe's tokens: beyond `tolerance` (1e-3 nats when both sides compute in
  float32, 0.5 otherwise: `BAND_TOLERANCE`) the engine computes with other weights (`differs`);
- the landed fraction f: how much of the trainer's movement since the last probe that was in sync (the reference)
  the engine's logprobs made too, on the tokens both probes share (their common prefix):
  f = <dE, dT> / <dT, dT>, dE = engine now - engine then, dT = trainer now - trainer then. A sync that landed gives
  f ~ 1, one that never did gives f ~ 0, one that landed partly lies between. f is judged only when the trainer moved
  by more than `RESOLUTION` times the sides' disagreement when in sync (the largest gap of the run's in-sync probes,
  at least `FLOAT32_NOISE` or `BAND_NOISE`: the noise); a smaller update is below what the probe resolves, which the record says (`resolved`).

The gap is off when it is beyond the tolerance, or (once a probe was in sync) beyond `RESOLUTION` x the noise.
Verdicts: `stale` (f < 0.25), `partial` (f outside [0.75, 1.33], or the gap off though f is within), `differs`
(f not resolved and the gap off: the first probe, or an update too small to judge), else `in_sync`.
The records go to OUTPUT_DIR/drift/probe_<step>.json (`write_probe`); `python -m vlmrl.alignment.drift` shows them
and puts a jump after a failed probe down to the weights.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from vlmrl.alignment.inputs import first_difference
from vlmrl.atomic import write_text_atomically

PROBE_KIND = "vlmrl.weight_probe"
PROBE_FORMAT_VERSION = 1
PROBE_FILE = re.compile(r"probe_(\d+)\.json")
PROBE_DIR = "drift"
IN_SYNC, STALE, PARTIAL, DIFFERS = "in_sync", "stale", "partial", "differs"
VERDICTS = (IN_SYNC, STALE, PARTIAL, DIFFERS)
FLOAT32_TOLERANCE = 1e-3
"""Per-token |dlogp| of the probe when both sides compute in float32: the compare tool's float32 drift tolerance."""
BAND_TOLERANCE = 0.5
"""Otherwise (a bfloat16 side): a bfloat16 model sits up to ~0.25 nats from its own float32 computation (measured on
the tiny Qwen3.5, whose linear-attention layers drift most), so a float32 trainer and a bfloat16 engine, or two
bfloat16 implementations, may sit up to twice that apart."""
RESOLUTION = 10.0
"""The trainer must have moved the probe's logprobs by more than this many times the noise for f to be judged: the
noise enters dE and dT on both probes, so f is then known to about +-0.2."""
MIN_NOISE = 1e-7
"""The noise is never taken below float32 rounding of a logprob (in-sync gaps of exactly 0)."""
FLOAT32_NOISE = 4e-6
"""Nor, in float32, below the largest |engine - trainer| measured on the demo's model between correct sides (3.9e-6:
SGLang's fp32 samples scored by the trainer, 32 rows): one lucky first probe must not make the later ones look off."""
BAND_NOISE = 0.03
"""The same with a bfloat16 side (0.029: vLLM's bfloat16 samples on the demo's model)."""
STALE_BELOW = 0.25
"""Stale: the engine made less than this of the trainer's movement along it (the landed fraction) AND moved less
than this of the trainer's largest movement at all (an engine that moved against the trainer has synced something)."""
LANDED_BAND = (0.75, 1.33)


class ProbeError(ValueError):
    """A probe file that cannot be read; the message names it."""


@dataclass
class ProbeRecord:
    """One probe of the engine's weights, after the sync of step `step` (0: before the first step)."""

    step: int
    engine_version: int
    """The step whose weights the fit loop believes the engine holds (the last sync the backend counted)."""
    token_ids: list[int]
    """The engine's greedy tokens for the probe request."""
    engine_logprobs: list[float]
    trainer_logprobs: list[float]
    """The trainer's logprobs of the same tokens, its weights after step `step`'s update, temperature 1."""
    tolerance: float
    max_abs_dlogp: float
    """The gap: max |engine - trainer| over the tokens."""
    noise: float
    """The sides' disagreement when in sync: the largest gap of this run's in-sync probes up to this one (this one's
    included when it is in sync), at least the noise floor."""
    reference_step: int | None
    """The last earlier probe that was in sync, which dE and dT are measured from; None for the first probe."""
    compared_tokens: int
    """Tokens this probe shares with the reference (their common prefix)."""
    trainer_moved: float | None
    """max |dT| over those tokens; None without a reference."""
    engine_moved: float | None
    landed_fraction: float | None
    """f (see the module docstring); None when not resolved."""
    resolved: bool
    verdict: str
    explanation: str

    @property
    def failed(self) -> bool:
        return self.verdict != IN_SYNC


def tolerance_for(engine_dtype: str, trainer_dtype: str) -> tuple[float, float]:
    """(gap tolerance, noise floor) of the probe for these compute dtypes.

    >>> tolerance_for("float32", "float32"), tolerance_for("bfloat16", "float32")
    ((0.001, 4e-06), (0.5, 0.03))
    """
    wide = {"float32", "float64"}
    if engine_dtype in wide and trainer_dtype in wide:
        return FLOAT32_TOLERANCE, FLOAT32_NOISE
    return BAND_TOLERANCE, BAND_NOISE


def judge(step: int, engine_version: int, token_ids: list[int], engine_logprobs: list[float],
          trainer_logprobs: list[float], tolerance: float, reference: ProbeRecord | None = None,
          noise_floor: float = MIN_NOISE) -> ProbeRecord:
    """This probe's record, judged against `reference`, the run's last earlier probe that was in sync (its `noise`
    is the run's noise so far; `ProbeState` keeps both); the noise is never taken below `noise_floor`
    (`tolerance_for`).

    A first probe is judged on its gap alone; here the trainer moved 0.01 nats and the engine with it:

    >>> first = judge(0, 0, [5, 6], [-1.0, -2.0], [-1.0, -2.0], 1e-3)
    >>> first.verdict, first.landed_fraction
    ('in_sync', None)
    >>> judge(1, 1, [5, 6], [-1.01, -2.01], [-1.01, -2.01], 1e-3, first).verdict
    'in_sync'

    An engine that did not move while the trainer did is stale, though the gap is within tolerance:

    >>> stale = judge(1, 1, [5, 6], [-1.0, -2.0], [-1.0005, -2.0005], 1e-3, first)
    >>> stale.verdict, stale.landed_fraction
    ('stale', 0.0)
    """
    engine = np.asarray(engine_logprobs, dtype=np.float64)
    trainer = np.asarray(trainer_logprobs, dtype=np.float64)
    if engine.shape != trainer.shape or len(token_ids) != engine.size:
        raise ValueError(f"probe of step {step}: {len(token_ids)} tokens, {engine.size} engine and {trainer.size} "
                         "trainer logprobs")
    gap = float(np.abs(engine - trainer).max()) if engine.size else 0.0
    noise = reference.noise if reference is not None else gap
    noise = max(noise, noise_floor, MIN_NOISE)
    compared, trainer_moved, engine_moved, fraction = 0, None, None, None
    if reference is not None:
        split = first_difference(token_ids, reference.token_ids)
        compared = len(token_ids) if split is None else split
        if compared:
            d_trainer = trainer[:compared] - np.asarray(reference.trainer_logprobs[:compared], dtype=np.float64)
            d_engine = engine[:compared] - np.asarray(reference.engine_logprobs[:compared], dtype=np.float64)
            trainer_moved = float(np.abs(d_trainer).max())
            engine_moved = float(np.abs(d_engine).max())
            if trainer_moved > RESOLUTION * noise:
                fraction = float(np.dot(d_engine, d_trainer) / np.dot(d_trainer, d_trainer))
    resolved = fraction is not None
    where = f"on {engine.size} probe tokens"
    # off: beyond the tolerance, or (with a noise measured on earlier in-sync probes) far beyond that noise
    beyond = not math.isfinite(gap) or gap > tolerance
    off = beyond or (reference is not None and gap > RESOLUTION * noise)
    how_far = (f"beyond the {tolerance:g}-nat tolerance" if beyond else
               f"{gap / noise:.0f}x the {noise:.3g} nats it sits at when in sync")
    since = f"since step {reference.step}'s probe" if reference is not None else ""
    # stale: the engine made little of the trainer's movement, both along it (the fraction) and in size: a partial
    # sync of a small model can move the engine as much as the trainer but against it (fraction < 0)
    if resolved and math.isfinite(gap) and fraction < STALE_BELOW and engine_moved < STALE_BELOW * trainer_moved:
        verdict = STALE
        explanation = (f"{since} the trainer moved up to {trainer_moved:.3g} nats {where}, the engine "
                       f"{engine_moved:.3g} (landed fraction {fraction:.2f}; gap {gap:.3g}): the sync did not land")
    elif resolved and math.isfinite(gap) and (off or not LANDED_BAND[0] <= fraction <= LANDED_BAND[1]):
        verdict = PARTIAL
        explanation = (f"{since} the engine made {fraction:.2f} of the trainer's movement (up to "
                       f"{trainer_moved:.3g} nats {where}) and is {gap:.3g} nats from it ({how_far}): the sync "
                       "landed partly")
    elif off:
        verdict = DIFFERS
        explanation = (f"the engine's logprobs are up to {gap:.3g} nats from the trainer's {where} ({how_far}): the "
                       "engine computes with other weights")
    else:
        verdict = IN_SYNC
        if resolved:
            explanation = f"{since} the engine made {fraction:.2f} of the trainer's movement; gap {gap:.3g} nats"
        elif reference is None:
            explanation = f"first probe: gap {gap:.3g} nats {where}, within {tolerance:g}"
        elif trainer_moved is None:
            explanation = (f"gap {gap:.3g} nats, within {tolerance:g}; the greedy tokens changed {since} (no shared "
                           "prefix), so how much of the update landed is not measured")
        else:
            explanation = (f"gap {gap:.3g} nats, within {tolerance:g}; {since} the trainer moved "
                           f"{trainer_moved:.3g} nats, below what the probe resolves ({RESOLUTION:g} x noise "
                           f"{noise:.3g}): a sync that did not land would look the same")
        noise = max(noise, gap)
    return ProbeRecord(step=step, engine_version=engine_version, token_ids=list(token_ids),
                       engine_logprobs=engine.tolist(), trainer_logprobs=trainer.tolist(), tolerance=tolerance,
                       max_abs_dlogp=gap, noise=noise, reference_step=None if reference is None else reference.step,
                       compared_tokens=compared, trainer_moved=trainer_moved, engine_moved=engine_moved,
                       landed_fraction=fraction, resolved=resolved, verdict=verdict, explanation=explanation)


class ProbeState:
    """A run's probes so far as the next one is judged against them: the last probe that was in sync (the
    reference; its `noise` is the run's). `state_dict` goes into a checkpoint, so a resumed run judges its first probe
    as the uninterrupted run would."""

    def __init__(self, noise_floor: float = MIN_NOISE):
        self.reference: ProbeRecord | None = None
        self.noise_floor = noise_floor

    def judge(self, step: int, engine_version: int, token_ids: list[int], engine_logprobs: list[float],
              trainer_logprobs: list[float], tolerance: float) -> ProbeRecord:
        record = judge(step, engine_version, token_ids, engine_logprobs, trainer_logprobs, tolerance,
                       self.reference, self.noise_floor)
        if record.verdict == IN_SYNC:
            self.reference = record
        return record

    def state_dict(self) -> dict:
        return {"reference": None if self.reference is None else asdict(self.reference)}

    def load_state_dict(self, state: dict) -> None:
        found = state.get("reference")
        self.reference = None if found is None else ProbeRecord(**{k: found[k] for k in _FIELDS})


# ---------------------------------------------------------------------------------------------------- files


def probe_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / PROBE_DIR / f"probe_{step:06d}.json"


def write_probe(output_dir: str | os.PathLike, record: ProbeRecord) -> Path:
    """The record into OUTPUT_DIR/drift/probe_<step>.json, written whole and renamed into place."""
    text = json.dumps({"kind": PROBE_KIND, "format_version": PROBE_FORMAT_VERSION, **asdict(record)},
                      allow_nan=False)
    return write_text_atomically(probe_path(output_dir, record.step), text + "\n")


def probe_files(output_dir: str | os.PathLike) -> list[tuple[Path, int]]:
    """(path, step) of every probe file, by step."""
    folder = Path(output_dir) / PROBE_DIR
    if not folder.is_dir():
        return []
    found = [(path, PROBE_FILE.fullmatch(path.name)) for path in folder.iterdir()]
    return sorted(((path, int(m.group(1))) for path, m in found if m), key=lambda item: item[1])


_FIELDS = {f.name for f in fields(ProbeRecord)}


def read_probes(output_dir: str | os.PathLike, upto: int | None = None) -> list[ProbeRecord]:
    """The run's probes, by step (those after `upto` left out); [] when it has none. Raises ProbeError naming a
    file that cannot be read."""
    out = []
    for path, step in probe_files(output_dir):
        if upto is not None and step > upto:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ProbeError(f"{path}: not a readable probe record ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != PROBE_KIND or (
                data.get("format_version") != PROBE_FORMAT_VERSION):
            raise ProbeError(f"{path}: not a vlmrl weight probe record of format {PROBE_FORMAT_VERSION}")
        missing = sorted(_FIELDS - data.keys())
        if missing:
            raise ProbeError(f"{path}: missing {missing}")
        record = ProbeRecord(**{k: data[k] for k in _FIELDS})
        if record.step != step or record.verdict not in VERDICTS:
            raise ProbeError(f"{path}: step {record.step} / verdict {record.verdict!r} do not fit the file")
        out.append(record)
    return out
