"""The embedded visual tasks' reward (`vlmrl.data.synthetic`): 1.0 when the response is the answer word.

Matching ignores case, surrounding whitespace, punctuation and special tokens left in the text, so "Red." and
" red\\n" both answer "red"; anything more ("the shape is red") is wrong: the prompt asks for the answer alone.
`format` (the response is exactly one word) is returned as a part but is not in the score, so the demo's reward is
exactly its accuracy.
"""

from __future__ import annotations

import re
import string
from typing import Any

from vlmrl.rewards.base import require_ground_truth

_SPECIAL = re.compile(r"<\|[^|]*\|>")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    """Lower case, special tokens and punctuation removed, whitespace collapsed.

    >>> normalise("  Red.<|im_end|>")
    'red'
    >>> normalise("The shape is  BLUE!")
    'the shape is blue'
    """
    return " ".join(_SPECIAL.sub(" ", str(text)).translate(_PUNCTUATION).lower().split())


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  ) -> dict[str, float]:
    """score = accuracy = exact match of the normalised answer; format = the answer is one word.

    >>> compute_score("synthetic/colour", "Red.", "red")
    {'score': 1.0, 'accuracy': 1.0, 'format': 1.0}
    >>> compute_score("synthetic/colour", "the shape is red", "red")
    {'score': 0.0, 'accuracy': 0.0, 'format': 0.0}
    >>> compute_score("synthetic/count", " 3", "3")
    {'score': 1.0, 'accuracy': 1.0, 'format': 1.0}
    """
    answer = normalise(solution_str)
    accuracy = 1.0 if answer == normalise(require_ground_truth(ground_truth)) else 0.0
    fmt = 1.0 if len(answer.split()) == 1 else 0.0
    return {"score": accuracy, "accuracy": accuracy, "format": fmt}
