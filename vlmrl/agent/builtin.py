"""Two ready tools: zoom into a prompt image (an image out) and check a geometry answer (geo3k, a tool reward).

Register them by path in the run config, e.g. `agent.tools=[{path: "vlmrl.agent.builtin:ImageZoomTool"}]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmrl.agent.tools import Tool, ToolContext, ToolOutput


@dataclass
class _ZoomState:
    images: list[Image.Image]


class ImageZoomTool(Tool):
    """Crops a box out of one of the prompt's images and shows it to the model (resized by the processor's rules,
    so a small box comes back enlarged). Coordinates are pixels of the image as the model sees it (resized)."""

    name = "zoom"
    description = "Zoom into a rectangular region of an image of the question to see it in more detail."
    parameters = {
        "type": "object",
        "properties": {
            "box": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                    "description": "[x1, y1, x2, y2] in pixels, top-left origin"},
            "image": {"type": "integer", "description": "which image of the question, from 0 (default 0)"},
        },
        "required": ["box"],
    }

    def __init__(self, min_side: int = 4):
        self.min_side = min_side
        """Smallest box side in pixels (a thinner box says nothing and cannot be resized sensibly)."""

    def create(self, context: ToolContext) -> _ZoomState:
        return _ZoomState(list(context.request.images))

    def execute(self, state: _ZoomState, arguments: dict[str, Any]) -> ToolOutput:
        index = arguments.get("image", 0)
        if not isinstance(index, int) or not 0 <= index < len(state.images):
            raise ValueError(f"image must be an integer in [0, {len(state.images) - 1}], got {index!r}"
                             if state.images else "the question has no image to zoom into")
        image = state.images[index]
        box = arguments.get("box")
        if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
            raise ValueError(f"box must be [x1, y1, x2, y2] (4 numbers), got {box!r}")
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        x1, y1 = max(0, x1), max(0, y1)
        x2, y2 = min(image.width, x2), min(image.height, y2)
        if x2 - x1 < self.min_side or y2 - y1 < self.min_side:
            raise ValueError(f"box {list(box)} leaves less than {self.min_side} pixels per side inside the "
                             f"{image.width}x{image.height} image")
        crop = image.crop((x1, y1, x2, y2))
        return ToolOutput(text=f"Zoomed into [{x1}, {y1}, {x2}, {y2}] of image {index}.", images=[crop],
                          metrics={"area_fraction": (x2 - x1) * (y2 - y1) / (image.width * image.height)})


@dataclass
class _AnswerState:
    ground_truth: Any
    scores: list[float] = field(default_factory=list)


MAX_ANSWER_CHARS = 64
"""Longest answer Geo3kAnswerTool grades (geometry answers are short; sympy's cost is not)."""


class Geo3kAnswerTool(Tool):
    r"""Checks a candidate answer against the row's ground truth with the geo3k grader (mathruler) and says whether it
    is right. Its reward (`reward_extra["tool/check_answer"]`) is the score of the LAST answer checked, 0 when none,
    so a model that keeps guessing gains nothing over one that checks once.

    This leaks correctness to the model by design (like verl's gsm8k tool example): use it to study tool use, and
    keep the task reward on the final `\boxed{}` answer."""

    name = "check_answer"
    description = "Check whether a final answer to the geometry question is correct."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the answer, e.g. 12 or 2\\sqrt{3}"}},
        "required": ["answer"],
    }

    def create(self, context: ToolContext) -> _AnswerState:
        return _AnswerState(context.request.ground_truth)

    def execute(self, state: _AnswerState, arguments: dict[str, Any]) -> str:
        from vlmrl.rewards.geo3k import accuracy_reward

        answer = arguments.get("answer")
        if not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise ValueError(f'arguments must be {{"answer": "..."}}, got {arguments!r}')
        # The grader hands the answer to sympy in this process: `9**9**8` computes for minutes holding the GIL
        # (mathruler guards `^` powers, not `**`), which would freeze every rollout thread past any tool timeout.
        if len(str(answer)) > MAX_ANSWER_CHARS or "**" in str(answer):
            raise ValueError(f"an answer must be at most {MAX_ANSWER_CHARS} characters, with ^ for powers (not **)")
        score = accuracy_reward("\\boxed{" + str(answer) + "}", state.ground_truth)
        state.scores.append(score)
        return f"The answer {answer} is {'correct' if score else 'not correct'}."

    def reward(self, state: _AnswerState) -> float:
        return state.scores[-1] if state.scores else 0.0

    def save_state(self, state: _AnswerState) -> dict[str, Any]:
        return {"scores": list(state.scores)}  # the ground truth comes back with the context

    def load_state(self, context: ToolContext, saved: dict[str, Any]) -> _AnswerState:
        return _AnswerState(context.request.ground_truth, [float(s) for s in saved["scores"]])
