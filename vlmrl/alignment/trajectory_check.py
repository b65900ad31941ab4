"""Agent trajectories: are the ids the agent loop built turn by turn the ids the chat template gives the final
conversation? (`python -m vlmrl.alignment.compare --gate trajectory`, with agent.enable.)

The loop builds a conversation's ids incrementally: the prompt's rendering, then each assistant turn's generated
ids, then each tool turn's rendering, appended. The trainer trains on those ids; a model served later (or an SFT set
made from the same conversations) sees the chat template's rendering of the whole conversation at once. Where the two
differ, the policy is trained on token sequences it will never be shown. This is verl's multi-turn
`tokenization_sanity_check` (modes strict / ignore_strippable), as a check with the cause in words.

The final conversation: the row's prompt messages, then per turn an assistant message (the turn's generated text,
special tokens kept, without the end-of-turn token the template adds itself) and the tool turn's message (with
agent.tool_turn_format=qwen2.5 a user message holding one `<tool_response>` block per reply, with its images; with
`template` one `tool` message per reply). It is rendered with the processor's chat template and tokenized; then the
first position where the two id lists differ is found (the rendering may go on past the built ids with what closes
the last turn: the end-of-turn token and a newline when the trajectory stopped by length). Its kind:

  special_tokens      either side has a special token there (`<|im_end|>`, `<|im_start|>`, vision markers...): the
                      turns are joined differently from how the template joins them
  assistant_text      inside an assistant turn: the generated ids are not what tokenizing their own text gives
                      (the model emitted a non-canonical tokenization), so the trained ids are not the served ones
  non_assistant_text  in the prompt or a tool turn: the loop renders tool output or the prompt otherwise

`same_text`: the decoded texts are equal (only the tokenization differs); `strippable`: they agree once whitespace is
removed (verl's ignore_strippable mode would pass it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

KINDS = ("special_tokens", "assistant_text", "non_assistant_text")
TOOL_RESPONSE = "<tool_response>\n{images}{text}\n</tool_response>"
"""One reply of a qwen2.5-format tool turn, as `vlmrl.agent.turns.TurnRenderer` writes it."""
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_SPECIAL = re.compile(r"^<\|[^|]+\|>$")


@dataclass
class TrajectoryMismatch:
    index: int
    sample_index: int
    kind: str
    position: int
    """Index into prompt + response ids of the first difference."""
    built: str
    """Decoded built ids around the difference (a few tokens either side)."""
    rendered: str
    strippable: bool
    """The decoded texts differ in whitespace only."""
    same_text: bool = False
    """The decoded texts are equal: only the tokenization differs."""

    def line(self) -> str:
        note = " (same text, other tokens)" if self.same_text else " (whitespace only)" if self.strippable else ""
        return (f"row {self.index} #{self.sample_index}: {self.kind} at token {self.position}: built {self.built!r} vs "
                f"template {self.rendered!r}{note}")


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def conversation(prompt_messages: list[dict[str, Any]], turn_ids: list[int], turn_mask: list[int],
                 tool_turns: list[list[list]], tokenizer, end_of_turn: str, tool_turn_format: str) -> list[dict]:
    """The final conversation as chat messages (see the module docstring)."""
    messages = [dict(m) for m in prompt_messages]
    tools = iter(tool_turns)
    for start, end, generated in _spans(turn_mask):
        if generated:
            text = tokenizer.decode(turn_ids[start:end], skip_special_tokens=False)
            messages.append({"role": "assistant", "content": text.removesuffix(end_of_turn)})
            continue
        replies = next(tools, None)
        if replies is None:
            raise ValueError("a tool turn in the ids with no recorded replies")
        if tool_turn_format == "qwen2.5":
            blocks = [TOOL_RESPONSE.format(images=VISION_PLACEHOLDER * count, text=text) for text, count in replies]
            messages.append({"role": "user", "content": "\n".join(blocks)})
        else:
            messages += [{"role": "tool", "content": [{"type": "image"}] * count + [{"type": "text", "text": text}]}
                         for text, count in replies]
    return messages


def first_difference(built: list[int], rendered: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(built, rendered)):
        if a != b:
            return i
    return None if len(rendered) >= len(built) else len(rendered)


def check_trajectory(processor, prompt_messages: list[dict[str, Any]], prompt_ids: list[int], turn_ids: list[int],
                     turn_mask: list[int], tool_turns: list[list[list]], tool_turn_format: str, *, index: int,
                     sample_index: int, closing_tokens: int = 3) -> TrajectoryMismatch | None:
    """The first difference between the built ids (prompt_ids + turn_ids) and the template's rendering of the final
    conversation; None when the built ids are a prefix of it followed by at most `closing_tokens` tokens that close
    the last turn."""
    tokenizer = processor.tokenizer
    end_of_turn = tokenizer.decode([processor.eos_token_ids[0]], skip_special_tokens=False)
    messages = conversation(prompt_messages, turn_ids, turn_mask, tool_turns, tokenizer, end_of_turn,
                            tool_turn_format)
    text = processor.hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    rendered = list(tokenizer.encode(text, add_special_tokens=False))
    built = list(prompt_ids) + list(turn_ids)
    at = first_difference(built, rendered)
    if at is None and len(rendered) - len(built) <= closing_tokens:
        return None
    if at is None:  # the template renders more after the last built token than closing the turn
        at = len(built)
    a, b = built[at] if at < len(built) else None, rendered[at] if at < len(rendered) else None
    specials = set(tokenizer.all_special_ids)

    def special(token):
        return token is not None and (token in specials or bool(_SPECIAL.match(tokenizer.convert_ids_to_tokens(token))))

    if special(a) or special(b):
        kind = "special_tokens"
    elif at >= len(prompt_ids) and turn_mask[min(at - len(prompt_ids), len(turn_mask) - 1)] == 1:
        kind = "assistant_text"
    else:
        kind = "non_assistant_text"
    window = slice(max(0, at - 3), at + 4)
    text_built, text_rendered = tokenizer.decode(built), tokenizer.decode(rendered)
    same = text_rendered.startswith(text_built)
    strippable = not same and "".join(text_rendered.split()).startswith("".join(text_built.split()))
    return TrajectoryMismatch(index, sample_index, kind, at, tokenizer.decode(built[window]),
                              tokenizer.decode(rendered[window]), strippable, same)
