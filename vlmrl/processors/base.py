"""The processor every model family shares: dataset row -> `RolloutRequest`, and request -> the trainer's inputs
(expanded ids, multi_modal_inputs, position ids). What differs with the family's image layout
(`InputFormat.image_layout`) is a subclass's: `vlmrl.processors.patches.PatchesProcessor` (Qwen-VL-style families,
GLM-4.1V) or `vlmrl.processors.tiles.TilesProcessor` (InternVL); `vlmrl.processors.loading.load_processor` builds
the family's. What differs per family within a layout (placeholder tokens, pixel bounds, timing of videos) is read
from its `vlmrl.models.families.ModelFamily`.

One request serves every backend: prompt ids hold ONE image placeholder (`<|image_pad|>`, GLM's `<|image|>`,
InternVL's `<IMG_CONTEXT>`) per image (the form vLLM and SGLang take; they expand it themselves, so expanded ids
would be expanded twice: a corrupted prompt, or a hang in SGLang), the images are already prepared, and the pad
tokens no backend may sample are named. The trainer side (expanded ids, pixel values, position ids) is derived from
the same request here.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from vlmrl.data.config import DataConfig
from vlmrl.models.families import ModelFamily
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.processors.images import ImageInputError, image_hash, load_image, source_name
from vlmrl.processors.video import VideoInputError, VideoSupport
from vlmrl.types import PromptInputs, RolloutRequest, Video

IMAGE_MARKER = "<image>"  # verl/EasyR1 rows mark image positions in the prompt text with it
VIDEO_MARKER = "<video>"  # ... and video positions with this


class Processor:
    """Turns dataset rows into `RolloutRequest`s and requests into the trainer's inputs; the image layout's methods
    are its subclass's. Build with `vlmrl.processors.loading.load_processor`."""

    def __init__(self, hf_processor: Any, model_config: dict, generation_config: dict, config: DataConfig,
                 family: ModelFamily):
        self.config = config
        self.family = family
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.image_processor = hf_processor.image_processor
        vocab = self.tokenizer.convert_tokens_to_ids
        self.image_token_id: int = int(model_config.get("image_token_id", vocab(family.inputs.image_placeholder)))
        self.video_token_id: int = int(model_config.get("video_token_id", vocab(family.inputs.video_placeholder)))
        self.banned_token_ids: list[int] = [self.image_token_id, self.video_token_id]
        self.eos_token_ids: list[int] = _eos_ids(generation_config, self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else generation_config.get("pad_token_id",
                                                                                       self.eos_token_ids[0]))
        self._image_setup(model_config)
        self.video = VideoSupport(hf_processor, model_config, config, self.image_factor, family)
        """Frame sampling, video inputs, video token counts (`vlmrl.processors.video`)."""


    # ---------------------------------------------------------------- the image layout's (each subclass's own)

    def _image_setup(self, model_config: dict) -> None:
        """The image facts of the family's layout (sizes, bounds, its own tokens), read once as the processor is built;
        sets `image_factor` (resized sides are multiples of it), `min_pixels` and `max_pixels`."""
        raise NotImplementedError

    def prepare_image(self, image: Any, what: str) -> Any:
        """A decoded dataset image -> the image every backend gets."""
        raise NotImplementedError

    def image_summary(self) -> str:
        """How images are prepared, for the log."""
        raise NotImplementedError

    def image_grid_thw(self, images: Sequence[Any]) -> torch.Tensor:
        """(N, 3) long: one row per prepared image, from its size (no pixel work)."""
        raise NotImplementedError

    def image_token_count(self, image: Any) -> int:
        """How many tokens one prepared image's placeholder expands to."""
        raise NotImplementedError

    def _expansion(self, token: int, grid: Sequence[int]) -> list[int]:
        """The tokens one placeholder of an image / video with this grid row stands for."""
        raise NotImplementedError

    def multi_modal_inputs(self, request: RolloutRequest) -> dict[str, torch.Tensor]:
        """The trainer's image and video inputs of a request (pixel values, grids); {} without images or videos."""
        raise NotImplementedError

    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(3, B, L) position ids of (B, L) EXPANDED ids (0 on padding)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- rows -> requests

    def prompt_messages(self, row: dict[str, Any], index: int = -1) -> list[dict[str, Any]]:
        """The chat messages `build_request` renders for a row (content parts for its images and videos)."""
        return _normalise_messages(row.get("prompt"), index)[0]

    def build_request(self, row: dict[str, Any], index: int = -1) -> RolloutRequest:
        """A verl/EasyR1 dataset row -> RolloutRequest (unexpanded ids, resized images, a fresh uid, metadata).

        `row["prompt"]`: chat messages (content a string with `<image>` markers, or a list of content parts of type
        image/text) or a plain string; `row["images"]`: {bytes} / {path} / PIL / bytes / path, in prompt order.

        Raises:
            FilteredRow: the config says to skip such a row (overlong prompt, bad image): count it and go on.
            BadRowError: the row is unusable and the config says to fail.
        """
        messages, inline_images, inline_videos = _normalise_messages(row.get("prompt"), index)
        sources = self._media_sources("image", list(row.get("images") or []), inline_images, messages, index)
        videos = self._videos(row, messages, inline_videos, index)
        images = []
        for i, source in enumerate(sources):
            try:
                loaded = load_image(source, self.config)
                images.append(self.prepare_image(loaded, source_name(source)))
            except ImageInputError as err:
                self._bad_image(index, f"image {i}: {err}")
        text = self.hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        found = prompt_ids.count(self.image_token_id)
        family = self.family
        if found != len(images):  # e.g. a literal <|image_pad|> typed in the prompt text
            self._bad_image(index, f"the rendered prompt holds {found} {family.inputs.image_placeholder} tokens for "
                                   f"{len(images)} images")
        found = prompt_ids.count(self.video_token_id)
        if found != len(videos):
            self._bad_image(index, f"the rendered prompt holds {found} {family.inputs.video_placeholder} tokens for "
                                   f"{len(videos)} videos")
        expanded = (len(prompt_ids) - len(images) + sum(self.image_token_count(im) for im in images)
                    - len(videos) + sum(self.video.token_count(v) for v in videos))
        if expanded > self.config.max_prompt_length:
            reason = (f"prompt is {expanded} tokens (expanded, with {len(images)} images, {len(videos)} videos) > "
                      f"max_prompt_length="
                      f"{self.config.max_prompt_length}; never truncated (it would cut through an image)")
            raise (FilteredRow if self.config.filter_overlong_prompts else BadRowError)(index, reason)
        reward_model = row.get("reward_model") or {}
        return RolloutRequest(
            uid=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            images=images,
            image_hashes=[image_hash(im) for im in images],
            banned_token_ids=list(self.banned_token_ids),
            videos=videos,
            data_source=str(row.get("data_source") or "unknown"),
            ground_truth=reward_model.get("ground_truth", row.get("answer")),
            extra_info=dict(row.get("extra_info") or {}),
            index=index,
        )

    def _media_sources(self, kind: str, listed: list[Any], inline: list[Any], messages: list[dict[str, Any]],
                       index: int) -> list[Any]:
        """A row's images or videos (`kind`), from its column or inline in the prompt, never both, one for each of
        the prompt's placeholders of that kind."""
        if listed and inline:
            self._bad_image(index, f"{kind}s both in the `{kind}s` column ({len(listed)}) and inline in the prompt's "
                                   f"content parts ({len(inline)}): give them in one place")
        sources = listed or inline
        placeholders = sum(_count_parts(m["content"], kind) for m in messages)
        if placeholders != len(sources):
            self._bad_image(index, f"{placeholders} {kind} placeholders in the prompt but {len(sources)} {kind}s")
        return sources

    def _videos(self, row: dict[str, Any], messages: list[dict[str, Any]], inline: list[Any], index: int) -> list:
        """The row's videos (`videos` column or inline content parts), sampled and resized, checked against the
        prompt's video placeholders."""
        listed = row.get("videos")
        listed = [] if listed is None else ([listed] if isinstance(listed, (str, dict, bytes)) else list(listed))
        sources = self._media_sources("video", listed, inline, messages, index)
        videos = []
        for i, source in enumerate(sources):
            try:
                videos.append(self.video.load(source))
            except VideoInputError as err:
                self._bad_image(index, f"video {i}: {err}")
        return videos

    def _bad_image(self, index: int, reason: str) -> None:
        raise (FilteredRow if self.config.on_bad_image == "filter" else BadRowError)(index, reason)

    # ---------------------------------------------------------------- requests -> trainer inputs

    def expand_prompt_ids(self, prompt_ids: Sequence[int], image_grid_thw: torch.Tensor | None,
                          video_grid_thw: torch.Tensor | None = None, videos: Sequence[Video] = ()) -> list[int]:
        """Unexpanded ids (one `<|image_pad|>` per image, one `<|video_pad|>` per video) -> expanded ids (one per
        merged patch), as the trainer's forward needs. image_grid_thw / video_grid_thw: (N, 3) for the N images /
        videos of these ids, in order; `videos`: those videos, needed where the family puts each video's
        timestamps in the text (Qwen3-VL: `VideoSupport.expansion`)."""
        timed = self.family.inputs.timestamps_in_text
        if timed and video_grid_thw is not None and len(videos) != len(video_grid_thw):
            raise ValueError(f"{self.family.name} videos expand with their timestamps: pass the {len(video_grid_thw)} "
                             f"videos of these ids (got {len(videos)})")
        videos = iter(videos)
        grids = {}
        for token, name, grid in ((self.image_token_id, "image", image_grid_thw),
                                  (self.video_token_id, "video", video_grid_thw)):
            rows = [] if grid is None else grid.tolist()
            count = sum(1 for t in prompt_ids if t == token)
            if count != len(rows):
                placeholder = getattr(self.family.inputs, f"{name}_placeholder")
                raise ValueError(f"{count} {placeholder} tokens in the prompt ids but {len(rows)} {name} grids")
            grids[token] = iter(rows)
        expanded: list[int] = []
        for token in prompt_ids:
            if token == self.video_token_id and timed:
                expanded.extend(self.video.expansion(next(videos), next(grids[token])))
            elif token in grids:
                expanded.extend(self._expansion(token, next(grids[token])))
            else:
                expanded.append(token)
        return expanded

    def prompt_inputs(self, request: RolloutRequest) -> PromptInputs:
        """Expand a request's prompt and compute its image inputs and position ids, once for all its samples."""
        mm_inputs = self.multi_modal_inputs(request)
        grid, video_grid = mm_inputs.get("image_grid_thw"), mm_inputs.get("video_grid_thw")
        ids = torch.tensor(self.expand_prompt_ids(request.prompt_ids, grid, video_grid, request.videos),
                           dtype=torch.long)
        positions = self.position_ids(ids.unsqueeze(0), None, grid, video_grid,
                                      mm_inputs.get("second_per_grid_ts"))[:, 0]
        return PromptInputs(request.uid, ids, positions, mm_inputs, request.data_source, request.ground_truth)


def _normalise_messages(prompt: Any, index: int) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """Chat messages with content parts for images and videos; also images and videos carried inline by content
    parts."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt is None or isinstance(prompt, dict) or not len(prompt):
        raise BadRowError(index, f"prompt must be a list of chat messages or a string, got {type(prompt).__name__}")
    messages, inline, inline_videos = [], [], []
    for message in prompt:
        if not isinstance(message, dict):
            raise BadRowError(index, f"prompt messages must be dicts (role, content), got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, str):
            if IMAGE_MARKER in content or VIDEO_MARKER in content:
                content = _split_markers(content)
        elif content is not None:
            # Parquet gives every content part every struct field (None where unset): drop those, so a text part
            # does not look like an image part to the counting below and to the chat template.
            content = [{k: v for k, v in dict(part).items() if v is not None} for part in content]
            for part in content:
                if part.get("type") == "image" and part.get("image") is not None:
                    inline.append(part.pop("image"))
                if part.get("type") == "video" and part.get("video") is not None:
                    inline_videos.append(part.pop("video"))
        else:
            raise BadRowError(index, f"message without content: {message!r}"[:300])
        messages.append({"role": message.get("role", "user"), "content": content})
    return messages, inline, inline_videos


_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


def _split_markers(text: str) -> list[dict[str, str]]:
    """'a <image> b <video>' -> [text a, image, text b, video] (the content-part form the chat template renders)."""
    parts: list[dict[str, str]] = []
    for piece in _MARKERS.split(text):
        if piece == IMAGE_MARKER:
            parts.append({"type": "image"})
        elif piece == VIDEO_MARKER:
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _count_parts(content: Any, kind: str) -> int:
    """Content parts of one kind ("image" also counts image_url parts); a plain string has none."""
    if isinstance(content, str):
        return 0
    keys = (kind, "image_url") if kind == "image" else (kind, "video_url")
    return sum(1 for part in content if part.get("type") == kind or any(k in part for k in keys))


def _eos_ids(generation_config: dict, tokenizer_eos: int | None) -> list[int]:
    eos = generation_config.get("eos_token_id")
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    if not ids:
        raise ValueError("the model names no EOS token (generation_config.json eos_token_id, tokenizer eos_token)")
    return [int(i) for i in ids]
