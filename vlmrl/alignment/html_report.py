"""The standalone HTML report: one file, no external assets, readable offline and attachable to a CI run.

Differing samples come first, side by side, with the first divergence highlighted and the images inline (thumbnails
stored in the artifacts); exact samples follow, folded.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

from vlmrl.alignment.artifact import ValidationRecord
from vlmrl.alignment.diff import CAUSE_LABELS, Cause, Comparison, SampleDiff
from vlmrl.alignment.report import _ci, _fmt, _p, _side
from vlmrl.atomic import write_text_atomically

MAX_TEXT = 3000
"""Characters of each response shown; longer responses are cut with a note."""
MAX_EXACT_SHOWN = 200
MAX_DIFFERING_SHOWN = 1000

_CAUSE_COLOURS = {
    Cause.INPUT_MISMATCH: "#b00020",
    Cause.REAL_DIVERGENCE: "#c2410c",
    Cause.UNCLASSIFIED_DIVERGENCE: "#7c3aed",
    Cause.NEAR_TIE: "#a16207",
    Cause.LENGTH_OR_FINISH: "#0369a1",
    Cause.REWARD_DISAGREEMENT: "#be185d",
    Cause.LOGPROB_DRIFT: "#4d7c0f",
}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1f2328}
header{background:#fff;border-bottom:1px solid #d0d7de;padding:16px 28px}
main{padding:8px 28px 40px;max-width:1400px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:26px 0 8px}
.verdict{display:inline-block;padding:3px 10px;border-radius:6px;color:#fff;font-weight:600;margin-right:8px}
.ok{background:#1a7f37}.bad{background:#cf222e}
.muted{color:#57606a} .mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
table{border-collapse:collapse;background:#fff;border:1px solid #d0d7de}
th,td{padding:5px 10px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.fail td{background:#ffebe9}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;font-weight:600}
.filters button{margin:0 6px 6px 0;padding:4px 10px;border:1px solid #d0d7de;border-radius:14px;background:#fff;
cursor:pointer} .filters button.on{background:#0969da;color:#fff;border-color:#0969da}
.card{background:#fff;border:1px solid #d0d7de;border-radius:8px;margin:12px 0;padding:12px 14px}
.card h3{font-size:14px;margin:0 0 6px}
.why{margin:4px 0 8px}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.side{border:1px solid #eaeef2;border-radius:6px;padding:8px;background:#fbfcfd;min-width:0}
.side .name{font-weight:600;margin-bottom:4px}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font-size:12.5px;
font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
mark{background:#ffd8b5;border-bottom:2px solid #c2410c;padding:0 1px}
.imgs{display:flex;gap:10px;flex-wrap:wrap;margin:6px 0}
.imgs figure{margin:0;text-align:center} .imgs img{image-rendering:pixelated;width:112px;border:1px solid #d0d7de}
.imgs figcaption{font-size:11px;color:#57606a}
details summary{cursor:pointer;font-weight:600;margin:8px 0}
"""

_JS = """
function filt(cause,btn){document.querySelectorAll('.filters button').forEach(b=>b.classList.remove('on'));
btn.classList.add('on');document.querySelectorAll('.card.diff').forEach(c=>{
c.style.display=(cause==='all'||c.dataset.cause===cause)?'':'none';});}
"""


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _badge(cause: Cause | None) -> str:
    if cause is None:
        return '<span class="badge" style="background:#1a7f37">exact</span>'
    return f'<span class="badge" style="background:{_CAUSE_COLOURS[cause]}">{_e(CAUSE_LABELS[cause])}</span>'


def _highlighted(text: str, split: int | None) -> str:
    """Escaped text with everything from the first differing character on marked."""
    cut = len(text) > MAX_TEXT
    shown = text[:MAX_TEXT]
    if split is None or split >= len(shown):
        body = _e(shown)
    else:
        body = _e(shown[:split]) + "<mark>" + _e(shown[split:]) + "</mark>"
    return body + (f'<span class="muted"> [... {len(text) - MAX_TEXT} more characters]</span>' if cut else "")


def _images(record: ValidationRecord, caption: str) -> str:
    if not record.thumbnails:
        return ""
    figures = []
    for i, b64 in enumerate(record.thumbnails):
        size = record.image_sizes[i] if i < len(record.image_sizes) else ["?", "?"]
        if not isinstance(b64, str) or not _BASE64.fullmatch(b64):  # an artifact is data, never markup
            figures.append(f"<figure><figcaption>{_e(caption)}image {i}: thumbnail is not base64 (left out)"
                           "</figcaption></figure>")
            continue
        figures.append(f'<figure><img alt="image {i}" src="data:image/png;base64,{b64}"><figcaption>{_e(caption)}'
                       f"image {i}: {_e(size[0])}x{_e(size[1])}</figcaption></figure>")
    return '<div class="imgs">' + "".join(figures) + "</div>"


def _divergence_table(sample: SampleDiff) -> str:
    split = sample.divergence
    if split is None:
        return ""

    def yes(v):
        return "-" if v is None else ("yes" if v else "no")

    return (
        '<table class="mono" style="margin:6px 0"><tr><th>at token</th><th>side</th><th>chose</th><th>its logprob</th>'
        "<th>other's token in its top-k</th><th>margin over other's token</th></tr>"
        f"<tr><td rowspan=2>{split.position}</td><td>A</td><td>{split.token_a}</td><td>{split.logprob_a:.5f}</td>"
        f"<td>{yes(split.b_in_top_a)}</td><td>{_fmt(split.margin_a, 5)}</td></tr>"
        f"<tr><td>B</td><td>{split.token_b}</td><td>{split.logprob_b:.5f}</td>"
        f"<td>{yes(split.a_in_top_b)}</td><td>{_fmt(split.margin_b, 5)}</td></tr></table>"
    )


def _card(comparison: Comparison, sample: SampleDiff, a: ValidationRecord, b: ValidationRecord,
          thumbs: dict[int, tuple[ValidationRecord, ValidationRecord]]) -> str:
    cls = "card diff" if sample.cause is not None else "card"
    cause = sample.cause.value if sample.cause is not None else "exact"
    split = sample.text.position if sample.text is not None else None
    ta, tb = thumbs.get(sample.index, (a, b))
    images = _images(ta, "")
    if a.image_hashes != b.image_hashes or a.image_sizes != b.image_sizes:
        images = _images(ta, "A ") + _images(tb, "B ")
    logprob = (f" | max |dlogprob| {_fmt(sample.max_abs_logprob_delta, 6)} over {sample.compared_positions} tokens"
               if sample.compared_positions else "")
    return (
        f'<div class="{cls}" data-cause="{cause}" id="row{_e(sample.index)}-{_e(sample.sample_index)}">'
        f"<h3>row {_e(sample.index)} &middot; sample {_e(sample.sample_index)} &middot; {_e(sample.data_source)} "
        f"{_badge(sample.cause)}</h3>"
        f'<div class="muted mono">reward {sample.reward_a:.4g} vs {sample.reward_b:.4g} | tokens {sample.length_a} vs '
        f"{sample.length_b} | finish {_e(sample.finish_a)} vs {_e(sample.finish_b)}{logprob} | "
        f"ground truth {_e(a.ground_truth)}</div>"
        + (f'<div class="why">{_e(sample.explanation)}</div>' if sample.explanation else "")
        + images + _divergence_table(sample)
        + '<div class="sides">'
        f'<div class="side"><div class="name">A: {_e(_side(comparison, "a"))}</div>'
        f"<pre>{_highlighted(a.response_text, split)}</pre></div>"
        f'<div class="side"><div class="name">B: {_e(_side(comparison, "b"))}</div>'
        f"<pre>{_highlighted(b.response_text, split)}</pre></div></div></div>"
    )


def _head_tables(comparison: Comparison) -> str:
    checks = "".join(
        f'<tr class="{"" if c.ok else "fail"}"><td>{"ok" if c.ok else "FAIL"}</td><td>{_e(c.name)}</td>'
        f'<td class="num">{c.value:.4g}</td><td class="num">{c.limit:.4g}</td><td>{_e(c.detail)}</td></tr>'
        for c in comparison.checks)
    scores = "".join(
        f"<tr><td>{_e(src)}</td><td class=num>{s.rows}</td><td class=num>{_fmt(s.mean_a)} {_ci(s.ci_a)}</td>"
        f"<td class=num>{_fmt(s.mean_b)} {_ci(s.ci_b)}</td><td class=num>{s.delta:+.3f} {_ci(s.ci_delta)}</td>"
        f"<td class=num>{_p(s.p_value)}</td><td>{_e(s.test)}</td></tr>" for src, s in comparison.scores.items())
    settings = "".join(f"<tr><td class=mono>{_e(k)}</td><td class=mono>{_e(a)}</td><td class=mono>{_e(b)}</td></tr>"
                       for k, a, b in comparison.setting_differences) or '<tr><td colspan=3>none</td></tr>'
    total = max(comparison.total, 1)
    outcomes = f"<tr><td>{_badge(None)}</td><td class=num>{comparison.exact}</td>" \
               f"<td class=num>{comparison.exact / total:.1%}</td></tr>" + "".join(
        f"<tr><td>{_badge(c)}</td><td class=num>{comparison.cause_counts.get(c, 0)}</td>"
        f"<td class=num>{comparison.cause_counts.get(c, 0) / total:.1%}</td></tr>" for c in Cause)
    parts = "".join(f"<tr><td>{_e(k)}</td><td class=num>{_fmt(a)}</td><td class=num>{_fmt(b)}</td></tr>"
                    for k, (a, b) in comparison.reward_parts.items())
    return (
        "<h2>Checks</h2><table><tr><th></th><th>check</th><th>value</th><th>limit</th><th>detail</th></tr>"
        f"{checks}</table>"
        f'<h2>Samples</h2><table><tr><th>outcome</th><th>count</th><th>share</th></tr>{outcomes}</table>'
        f'<p class="muted">logprobs over common prefixes: max |delta| {_fmt(comparison.max_abs_logprob_delta, 6)}, '
        f"mean |delta| {_fmt(comparison.mean_abs_logprob_delta, 6)} nats</p>"
        f"<h2>Scores</h2><p class=muted>Mean reward per dataset row (mean over its samples), 95% bootstrap interval "
        f"over rows, two-sided paired test of no difference.</p><table><tr><th>data source</th><th>rows</th>"
        f"<th>A: {_e(comparison.label_a)}</th><th>B: {_e(comparison.label_b)}</th><th>delta (B-A)</th><th>p</th>"
        f"<th>test</th></tr>{scores}</table>"
        + (f"<h2>Reward parts</h2><table><tr><th>part</th><th>A</th><th>B</th></tr>{parts}</table>" if parts else "")
        + f"<h2>Settings that differ</h2><table><tr><th>key</th><th>A</th><th>B</th></tr>{settings}</table>"
    )


def render_html(comparison: Comparison, records_a: list[ValidationRecord], records_b: list[ValidationRecord]) -> str:
    """The whole report as one HTML string."""
    by_key_a = {(r.index, r.sample_index): r for r in records_a}
    by_key_b = {(r.index, r.sample_index): r for r in records_b}
    # Thumbnails live on sample 0 of each row; every sample of the row shows them.
    thumbs = {r.index: (r, by_key_b[(r.index, r.sample_index)]) for r in records_a if r.thumbnails}
    order = list(Cause)
    differing = sorted(comparison.differing(), key=lambda s: (order.index(s.cause), s.index, s.sample_index))
    same = [s for s in comparison.samples if s.cause is None]

    def card(s: SampleDiff) -> str:
        key = (s.index, s.sample_index)
        return _card(comparison, s, by_key_a[key], by_key_b[key], thumbs)

    buttons = '<button class="on" onclick="filt(\'all\',this)">all differing</button>' + "".join(
        f'<button onclick="filt(\'{c.value}\',this)">{_e(CAUSE_LABELS[c])} ({comparison.cause_counts[c]})</button>'
        for c in Cause if comparison.cause_counts.get(c))
    verdict = ('<span class="verdict ok">ALIGNED</span>' if comparison.ok
               else '<span class="verdict bad">NOT ALIGNED</span>')
    meta = comparison.meta_a
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>vlmrl alignment: {_e(comparison.label_a)} '
        f"vs {_e(comparison.label_b)}</title><style>{_CSS}</style><script>{_JS}</script></head><body>"
        f"<header><h1>{verdict}{_e(_side(comparison, 'a'))} vs {_e(_side(comparison, 'b'))}</h1>"
        f'<div class="muted">model {_e(meta.model_path)} &middot; data {_e(", ".join(meta.dataset.paths))} '
        f"({meta.dataset.rows} rows) &middot; {comparison.total} samples &middot; "
        f"{'greedy' if comparison.greedy else 'sampled (tokens compared statistically only)'} &middot; "
        f"steps {comparison.meta_a.step} / {comparison.meta_b.step}</div></header><main>"
        + _head_tables(comparison)
        + f"<h2>Differing samples ({len(differing)})</h2>"
        + (f'<div class="filters">{buttons}</div>' if differing else '<p class="muted">none</p>')
        + "".join(card(s) for s in differing[:MAX_DIFFERING_SHOWN])
        + (f'<p class="muted">{len(differing) - MAX_DIFFERING_SHOWN} more in the JSON report</p>'
           if len(differing) > MAX_DIFFERING_SHOWN else "")
        + f"<details><summary>Exact samples ({len(same)})</summary>"
        + "".join(card(s) for s in same[:MAX_EXACT_SHOWN])
        + (f'<p class="muted">{len(same) - MAX_EXACT_SHOWN} more not shown</p>' if len(same) > MAX_EXACT_SHOWN else "")
        + "</details></main></body></html>\n"
    )


def write_html_report(comparison: Comparison, records_a: list[ValidationRecord], records_b: list[ValidationRecord],
                      path: str | os.PathLike) -> Path:
    return write_text_atomically(path, render_html(comparison, records_a, records_b))
