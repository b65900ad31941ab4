"""Levels 2 and 3 of a diff for one pair of responses, token by token: where the two sides' tokens split and how that
split is judged (vLLM's divergence-aware rule: is each side's token in the other's top-k, by what margin), the texts
around the first differing character, and the logprob gaps over the tokens both sides share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlmrl.alignment.artifact import ValidationRecord
from vlmrl.alignment.inputs import first_difference

TEXT_WINDOW = 60
"""Characters of response text shown on each side of a divergence."""


@dataclass
class Divergence:
    """The first response position where the two sides chose different tokens."""

    position: int
    token_a: int
    token_b: int
    logprob_a: float
    """Side A's logprob of its own token."""
    logprob_b: float
    b_in_top_a: bool | None
    """Whether B's token is in A's top-k there (None: A has no top-k)."""
    a_in_top_b: bool | None
    margin_a: float | None
    """lp_a[token_a] - lp_a[token_b]: how strongly A preferred its token (None when token_b is not in A's top-k)."""
    margin_b: float | None


@dataclass
class TextWindow:
    """The responses around the first character where their texts differ (for the terminal and HTML)."""

    position: int
    """Character offset of the first difference (== the common prefix length)."""
    before: str
    """Up to TEXT_WINDOW characters of the shared text right before it."""
    after_a: str
    after_b: str


def top_lookup(top: list[list[list[float]]] | None, position: int) -> dict[int, float] | None:
    """The top-k at `position` as {token: logprob}; None when not recorded, or when it holds fewer than 2 entries
    (a top-1 list is the side's own token: the other side's could never be found in it, which would judge every
    near-tie a real divergence)."""
    if top is None or position >= len(top) or top[position] is None or len(top[position]) < 2:
        return None
    return {int(token): float(logprob) for token, logprob in top[position]}


def judge_divergence(a: ValidationRecord, b: ValidationRecord, position: int) -> Divergence:
    """Level 3 at the split: is each side's token in the other's top-k, and by how much did each side prefer its own."""
    ta, tb = a.response_ids[position], b.response_ids[position]
    lpa, lpb = a.response_logprobs[position], b.response_logprobs[position]
    top_a, top_b = top_lookup(a.top_logprobs, position), top_lookup(b.top_logprobs, position)
    b_in_a = None if top_a is None else tb in top_a
    a_in_b = None if top_b is None else ta in top_b
    return Divergence(
        position=position, token_a=ta, token_b=tb, logprob_a=lpa, logprob_b=lpb,
        b_in_top_a=b_in_a, a_in_top_b=a_in_b,
        margin_a=lpa - top_a[tb] if b_in_a else None,
        margin_b=lpb - top_b[ta] if a_in_b else None,
    )


def text_window(text_a: str, text_b: str, width: int = TEXT_WINDOW) -> TextWindow | None:
    """The two texts around their first differing character; None when the texts are equal."""
    pos = first_difference(list(text_a), list(text_b))
    if pos is None:
        return None
    return TextWindow(pos, text_a[max(0, pos - width):pos], text_a[pos:pos + width], text_b[pos:pos + width])


def logprob_deltas(a: ValidationRecord, b: ValidationRecord, upto: int) -> np.ndarray:
    """|lp_a - lp_b| over the first `upto` response positions, where both sides emitted the same tokens. (upto,)"""
    la = np.asarray(a.response_logprobs[:upto], dtype=np.float64)
    lb = np.asarray(b.response_logprobs[:upto], dtype=np.float64)
    deltas = np.abs(la - lb)
    # -inf on both sides (an impossible token both emitted) is agreement, not an infinite delta.
    return np.where(np.isneginf(la) & np.isneginf(lb), 0.0, deltas)


def tempered_delta(a: ValidationRecord, b: ValidationRecord, upto: int) -> float | None:
    """max |one side's logprobs - the other side's tempered logprobs| over the first `upto` positions, for the side
    pair where one recorded `tempered_logprobs`; None when neither did (or nothing is compared)."""
    for raw, side in ((a, b), (b, a)):
        if side.tempered_logprobs is not None and upto:
            other = np.asarray(raw.response_logprobs[:upto], dtype=np.float64)
            return float(np.abs(other - np.asarray(side.tempered_logprobs[:upto], dtype=np.float64)).max())
    return None
