"""Which thresholds a comparison starts from, and why: the dtype each side computed in, as its header records it.

Correct float32 engines agree to ~1e-5 nats per token; bfloat16 ones split on near-ties with margins up to ~0.03 nats
and drift by up to ~0.1. So the defaults follow the two sides' dtypes (`ArtifactMeta.dtype`: what the engine, or the
trainer, computed in, resolved: never `auto`). An artifact written before headers recorded it says only its
configured rollout.dtype; `auto` there is unknown (the engine resolved it by device and model and did not say), so
the looser bfloat16 band is assumed, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.alignment.artifact import ArtifactMeta

WIDE_DTYPES = ("float32", "float64")
"""Dtypes whose correct implementations agree to float32 rounding."""

FP32_THRESHOLDS = {"near_tie_margin": 0.01, "drift_tolerance": 0.001, "max_mean_logprob_delta": 0.0001}
"""Defaults when both sides computed in float32 or wider (`side_dtype`). The `Thresholds` defaults are sized for
bf16, where two correct engines split on near-ties with margins up to ~0.03 nats; in float32 correct engines agree to
~1e-5 nats (measured 2e-6..4e-6 on the tiny models, images and video), so:
- a split with a 0.03-0.2 nat margin is a real difference: measured on Qwen3-VL with an engine left without mrope
  interleaving, which the bf16 defaults would call 6 near-ties and aligned;
- a token 1e-3 nats off is drift, and a mean of 1e-4 is not rounding: measured on SGLang's Qwen2.5-VL video tower
  attending across temporal patches (1e-3..7e-3 nats per token, mean ~1e-3), which limits of 1e-2 / 1e-3 called
  aligned on a 9-row video set."""


def side_dtype(meta: ArtifactMeta) -> str | None:
    """The dtype a side computed in: its header's `dtype`; in an artifact written before headers recorded it, its
    configured rollout.dtype when that names one; None (unknown) when it says `auto`."""
    if meta.dtype:
        return meta.dtype
    configured = (meta.config.get("rollout") or {}).get("dtype")
    return configured if configured and configured != "auto" else None


def dtype_difference(meta_a: ArtifactMeta, meta_b: ArtifactMeta) -> str:
    """"float32 vs bfloat16" when the sides computed in different known dtypes, else ""."""
    a, b = side_dtype(meta_a), side_dtype(meta_b)
    return f"{a} vs {b}" if a and b and a != b else ""


@dataclass
class Precision:
    """The two sides' dtypes and the threshold defaults they choose."""

    dtype_a: str | None
    """Side A's dtype (None: unknown)."""
    dtype_b: str | None
    float32: bool
    """Both computed in float32 or wider: `FP32_THRESHOLDS` are the defaults."""
    reason: str
    """Why these defaults, in words (the reports print it)."""

    @property
    def band(self) -> str:
        """The defaults' name: float32, or bfloat16 (`Thresholds`' own)."""
        return "float32" if self.float32 else "bfloat16"

    @property
    def defaults(self) -> dict[str, float]:
        """The threshold defaults that differ from `Thresholds`' own (the bfloat16 band)."""
        return dict(FP32_THRESHOLDS) if self.float32 else {}


def precision_of(meta_a: ArtifactMeta, meta_b: ArtifactMeta, labels: tuple[str, str] = ("A", "B")) -> Precision:
    """The threshold defaults two artifacts' recorded dtypes choose, with the reason.

    >>> from vlmrl.alignment.artifact import DatasetIdentity
    >>> def side(dtype, configured):
    ...     return ArtifactMeta("vllm", "vllm", "0", "m", DatasetIdentity([], 0, ""), {},
    ...                         config={"rollout": {"dtype": configured}}, dtype=dtype)
    >>> precision_of(side("float32", "auto"), side("float32", "auto")).float32
    True
    >>> precision_of(side("bfloat16", "auto"), side("float32", "float32")).reason
    'a side computed below float32 (A bfloat16, B float32)'
    >>> precision_of(side("float32", "auto"), side("", "auto")).reason.split(";")[0]
    'B recorded no dtype (A float32, B unknown'
    """
    a, b = side_dtype(meta_a), side_dtype(meta_b)
    named = f"{labels[0]} {a or 'unknown'}, {labels[1]} {b or 'unknown'}"
    if a in WIDE_DTYPES and b in WIDE_DTYPES:
        return Precision(a, b, True, f"both sides computed in float32 or wider ({named})")
    unknown = [label for label, dtype in zip(labels, (a, b)) if dtype is None]
    if unknown:
        return Precision(a, b, False, (
            f"{' and '.join(unknown)} recorded no dtype ({named}; rollout.dtype auto in an artifact written before "
            "headers recorded the dtype the engine resolved it to), so lower precision is assumed; if both ran in "
            "float32, give " + " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in FP32_THRESHOLDS.items())))
    return Precision(a, b, False, f"a side computed below float32 ({named})")
