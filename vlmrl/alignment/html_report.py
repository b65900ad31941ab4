"""The standalone HTML report: one file, no external assets, readable offline and attachable to a CI run.

Differing samples come first, side by side, with the first divergence highlighted and the images inline (thumbnails
stored in the artifacts); exact samples follow, folded. The page is `templates/report.html.j2`, rendered by jinja2
with autoescaping on: an artifact is data, so no value from it can become markup.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from vlmrl.alignment.artifact import ValidationRecord
from vlmrl.alignment.causes import CAUSE_LABELS, Cause
from vlmrl.alignment.diff import Comparison
from vlmrl.alignment.report import _ci, _fmt, _p, _side, thresholds_line
from vlmrl.alignment.sample_diff import SampleDiff
from vlmrl.atomic import write_text_atomically

MAX_TEXT = 3000
"""Characters of each response shown; longer responses are cut with a note."""
MAX_EXACT_SHOWN = 200
MAX_DIFFERING_SHOWN = 1000

_CAUSE_COLOURS = {
    Cause.INPUT_MISMATCH: "#b00020",
    Cause.WEIGHTS_DIFFER: "#9f1239",
    Cause.REAL_DIVERGENCE: "#c2410c",
    Cause.UNCLASSIFIED_DIVERGENCE: "#7c3aed",
    Cause.NEAR_TIE: "#a16207",
    Cause.LENGTH_OR_FINISH: "#0369a1",
    Cause.REWARD_DISAGREEMENT: "#be185d",
    Cause.LOGPROB_DRIFT: "#4d7c0f",
    Cause.PROCESSED_LOGPROBS: "#0f766e",
    Cause.PRECISION: "#64748b",
    Cause.ROUTING: "#1d4ed8",
}

_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass
class _Card:
    """One sample's card: its diff, both sides' records, and the image strips to show (one, or A's and B's)."""

    sample: SampleDiff
    a: ValidationRecord
    b: ValidationRecord
    split: int | None
    """First differing character of the response texts (None: they do not differ)."""
    images: list[tuple[ValidationRecord, str]]


def _is_base64(value: object) -> bool:
    return isinstance(value, str) and _BASE64.fullmatch(value) is not None


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.tests["base64"] = _is_base64
    return env.get_template("report.html.j2")


def _card(sample: SampleDiff, a: ValidationRecord, b: ValidationRecord,
          thumbs: dict[int, tuple[ValidationRecord, ValidationRecord]]) -> _Card:
    # Thumbnails live on sample 0 of each row; every sample of the row shows them, both sides' when they differ.
    ta, tb = thumbs.get(sample.index, (a, b))
    images = [(ta, "")]
    if a.image_hashes != b.image_hashes or a.image_sizes != b.image_sizes:
        images = [(ta, "A "), (tb, "B ")]
    return _Card(sample, a, b, sample.text.position if sample.text is not None else None, images)


def render_html(comparison: Comparison, records_a: list[ValidationRecord], records_b: list[ValidationRecord]) -> str:
    """The whole report as one HTML string."""
    by_key_a = {(r.index, r.sample_index): r for r in records_a}
    by_key_b = {(r.index, r.sample_index): r for r in records_b}
    thumbs = {r.index: (r, by_key_b[(r.index, r.sample_index)]) for r in records_a if r.thumbnails}
    order = list(Cause)
    differing = sorted(comparison.differing(), key=lambda s: (order.index(s.cause), s.index, s.sample_index))
    same = [s for s in comparison.samples if s.cause is None]

    def cards(samples: list[SampleDiff]) -> list[_Card]:
        return [_card(s, by_key_a[(s.index, s.sample_index)], by_key_b[(s.index, s.sample_index)], thumbs)
                for s in samples]

    return _template().render(
        comparison=comparison, meta=comparison.meta_a, total=max(comparison.total, 1), causes=order,
        label_a=_side(comparison, "a"), label_b=_side(comparison, "b"),
        differing=differing, differing_cards=cards(differing[:MAX_DIFFERING_SHOWN]),
        same=same, same_cards=cards(same[:MAX_EXACT_SHOWN]),
        max_text=MAX_TEXT, max_differing=MAX_DIFFERING_SHOWN, max_exact=MAX_EXACT_SHOWN,
        labels=CAUSE_LABELS, colours=_CAUSE_COLOURS, fmt=_fmt, ci=_ci, p=_p, thresholds=thresholds_line(comparison),
    )


def write_html_report(comparison: Comparison, records_a: list[ValidationRecord], records_b: list[ValidationRecord],
                      path: str | os.PathLike) -> Path:
    return write_text_atomically(path, render_html(comparison, records_a, records_b))
