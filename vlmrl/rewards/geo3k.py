r"""The geometry3k reward, as verl scores it: 0.9 * accuracy + 0.1 * format, both parts also returned apart.

accuracy: the content of the LAST `\boxed{...}` graded against the ground truth by mathruler (sympy-backed: 1/2, 0.5
and \frac{1}{2} agree). format: the response is `<think>...</think>` followed by a `\boxed{...}` answer.
Reported numbers from other frameworks differ in which of these they call "accuracy": we return all three, named.
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.rewards.base import require_ground_truth

FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(response: str) -> float:
    r"""1.0 when the response is reasoning in <think> </think> tags and then a \boxed{} answer, else 0.0.

    >>> format_reward(r"<think>x + 30 = 90, so x = 60.</think> The answer is \boxed{60}.")
    1.0
    >>> format_reward(r"The answer is \boxed{60}.")
    0.0
    >>> format_reward(r"\boxed{60} <think>late</think>")
    0.0
    >>> format_reward(r" <think>x</think> \boxed{60}")  # verl matches the response as it is, without stripping
    0.0
    """
    return 1.0 if _FORMAT.fullmatch(response) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    r"""1.0 when the last \boxed{} answer equals the ground truth mathematically, else 0.0 (also without a box).

    >>> accuracy_reward(r"<think>half</think> \boxed{\frac{1}{2}}", "0.5")
    1.0
    >>> accuracy_reward(r"first \boxed{3}, no: \boxed{4}", "4")
    1.0
    >>> accuracy_reward("4", "4")
    0.0
    """
    from mathruler.grader import extract_boxed_content, grade_answer

    require_ground_truth(ground_truth)
    if r"\boxed{" not in response:
        return 0.0  # mathruler's "None" for a missing box must never match a ground truth of "None"
    return 1.0 if grade_answer(extract_boxed_content(response), str(ground_truth)) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  format_weight: float = FORMAT_WEIGHT) -> dict[str, float]:
    r"""score = (1 - format_weight) * accuracy + format_weight * format (verl's geo3k score).

    >>> compute_score("hiyouga/geometry3k", r"<think>...</think> \boxed{2\sqrt{3}}", r"2 \sqrt{3}")
    {'score': 1.0, 'accuracy': 1.0, 'format': 1.0}
    >>> compute_score("hiyouga/geometry3k", r"\boxed{5}", "5")
    {'score': 0.9, 'accuracy': 1.0, 'format': 0.0}
    >>> compute_score("hiyouga/geometry3k", r"<think>...</think> \boxed{6}", "5")
    {'score': 0.1, 'accuracy': 0.0, 'format': 1.0}
    """
    accuracy = accuracy_reward(solution_str, ground_truth)
    fmt = format_reward(solution_str)
    return {"score": (1.0 - format_weight) * accuracy + format_weight * fmt, "accuracy": accuracy, "format": fmt}
