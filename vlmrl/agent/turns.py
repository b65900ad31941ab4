"""Tool turns as tokens: what the model sees between two of its own turns.

Two formats (`agent.tool_turn_format`): "qwen2.5", Qwen2.5's tool format whatever the checkpoint's template says (all
replies of one assistant turn share one user turn of `<tool_response>...</tool_response>` blocks, images inside), and
"template", one `tool` message per reply rendered by the checkpoint's own chat template. Either way the turn starts
with what the template puts after an assistant message's content (`<|im_end|>\n` for Qwen, nothing for GLM-4.1V,
whose tool turn opens with the stop token `<|observation|>`; a generated stop token is not repeated) and ends with
the template's generation prompt, so the whole conversation reads exactly as the chat template would render it.
Every token of a tool turn gets response_mask 0. The rendered turn: docs/agent.md."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from PIL import Image

VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_PROBE = "\x00vlmrl-probe\x00"  # a content string no template produces by itself


@dataclass
class ToolReply:
    """What one call produced, ready to show: text (error messages included) and resized images."""

    text: str
    images: list[Image.Image] = field(default_factory=list)


class TurnRenderer:
    """Renders tool turns to token ids with the processor's tokenizer and chat template."""

    def __init__(self, hf_processor, tokenizer, image_token_id: int, turn_format: str = "qwen2.5"):
        self.hf_processor = hf_processor
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.turn_format = turn_format
        if turn_format == "qwen2.5" and (tokenizer.convert_tokens_to_ids("<|im_start|>") is None
                                         or tokenizer.convert_tokens_to_ids("<|image_pad|>") != image_token_id):
            raise ValueError("agent.tool_turn_format=qwen2.5 writes tool turns in Qwen2.5's tokens (<|im_start|>, "
                             "<|vision_start|><|image_pad|>), which this model's tokenizer does not have or "
                             "does not take images by (InternVL's <IMG_CONTEXT>): set "
                             "agent.tool_turn_format=template (the checkpoint's own chat template renders them)")
        self.assistant_suffix, self.generation_prompt = self._template_pieces()
        # special tokens a tool's text must not be able to inject (an <|image_pad|> without an image breaks the step)
        specials = [tok for tok in tokenizer.get_added_vocab() if tok.startswith("<|") and tok.endswith("|>")]
        self._special_re = re.compile("|".join(re.escape(tok) for tok in specials)) if specials else None

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _template_pieces(self) -> tuple[str, str]:
        """(text after an assistant message's content, the generation prompt), read off the chat template."""
        system = [{"role": "system", "content": "s"}]
        with_assistant = self._render(system + [{"role": "assistant", "content": _PROBE}], False)
        suffix = with_assistant.split(_PROBE, 1)[1]
        base = self._render(system, False)
        prompt = self._render(system, True)
        if not prompt.startswith(base):
            raise ValueError("the chat template's generation prompt is not a suffix of the rendered conversation")
        return suffix, prompt[len(base):]

    def neutralise(self, text: str) -> str:
        """Break up special-token strings in tool text (`<|im_end|>` -> `< |im_end|>`) so they stay plain text."""
        if self._special_re is None:
            return text
        return self._special_re.sub(lambda m: "< " + m.group(0)[1:], text)

    def tool_turn_text(self, replies: list[ToolReply], last_token_text: str) -> str:
        """The text of one tool turn that follows an assistant turn ending in `last_token_text`."""
        suffix = self.assistant_suffix
        if self.turn_format == "qwen2.5":
            body = "<|im_start|>user"
            for reply in replies:
                body += "\n<tool_response>\n" + VISION_PLACEHOLDER * len(reply.images)
                body += self.neutralise(reply.text) + "\n</tool_response>"
            body += "<|im_end|>\n" + self.generation_prompt
        else:
            messages = [{"role": "tool", "content": [{"type": "image"} for _ in r.images]
                         + [{"type": "text", "text": self.neutralise(r.text)}]} for r in replies]
            system = [{"role": "system", "content": "s"}]
            base = self._render(system, False)
            full = self._render(system + messages, True)
            if not full.startswith(base):
                raise ValueError("the chat template renders a tool message by changing earlier messages")
            body = full[len(base):]
        text = suffix + body
        if last_token_text and text.startswith(last_token_text):
            # the model generated it itself: Qwen's end-of-turn <|im_end|>, or GLM's <|observation|>, a stop token
            # that opens the tool turn (its template puts nothing after an assistant message)
            text = text[len(last_token_text):]
        return text

    def tool_turn_ids(self, replies: list[ToolReply], last_token_id: int) -> list[int]:
        """Token ids of one tool turn, with one `<|image_pad|>` per reply image (unexpanded)."""
        last_text = self.tokenizer.decode([last_token_id], skip_special_tokens=False)
        ids = list(self.tokenizer.encode(self.tool_turn_text(replies, last_text), add_special_tokens=False))
        expected = sum(len(r.images) for r in replies)
        if ids.count(self.image_token_id) != expected:
            raise RuntimeError(f"tool turn holds {ids.count(self.image_token_id)} image tokens for {expected} images")
        return ids
