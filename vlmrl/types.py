"""Typed records passed between stages: dataset row -> request -> rollout result -> padded sample -> train batch.

Shapes use: P = padded prompt length, R = padded response length, L = P + R, B = batch size.
All token ids in a `Sample`/`TrainBatch` are EXPANDED (one `<|image_pad|>` / `<|video_pad|>` per merged vision patch,
as the trainer's forward needs); a `RolloutRequest` holds UNEXPANDED ids (one `<|image_pad|>` per image and one
`<|video_pad|>` per video, as both engines take them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image


@dataclass
class Video:
    """One video as every backend receives it: frames sampled and resized ONCE by `vlmrl.processors.video`, with the
    timing the model's position ids need. Every backend gets exactly these frames and this timing."""

    frames: np.ndarray
    """(T, H, W, 3) uint8 RGB: the sampled frames, resized (sides multiples of the model's factor, 28 or 32), T a
    multiple of the temporal patch size (2)."""
    fps: float
    """Frame rate of the SOURCE video (for a list of frame images: the rate they were taken at, data.video_fps)."""
    frame_indices: list[int]
    """Index in the source of each sampled frame (len T)."""
    total_frames: int
    """Frames in the source video."""
    hash: str = ""
    """sha256 over the frames' shape and bytes and the timing: equal inputs have equal hashes on every backend."""

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def sample_fps(self) -> float:
        """Frames per second of the sampled frames (qwen-vl-utils' `sample_fps`; transformers' `sampled_fps`)."""
        return len(self.frame_indices) / self.total_frames * self.fps

    @property
    def timestamps(self) -> list[float]:
        """Time of each sampled frame in seconds."""
        return [i / self.fps for i in self.frame_indices]

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps

    def metadata(self) -> dict[str, Any]:
        """transformers' / vLLM's video metadata of these frames (the processor then samples nothing)."""
        return {"fps": float(self.fps), "total_num_frames": int(self.total_frames),
                "frames_indices": [int(i) for i in self.frame_indices], "duration": float(self.duration),
                "width": int(self.frames.shape[2]), "height": int(self.frames.shape[1])}


@dataclass
class RolloutRequest:
    """One prompt, ready for any rollout backend. Built by `vlmrl.processors.base.Processor.build_request`."""

    uid: str
    """Unique id of this prompt; every sample generated from it shares it (the GRPO group id)."""
    prompt_ids: list[int]
    """Chat-templated prompt token ids with ONE `<|image_pad|>` per image (unexpanded)."""
    images: list[Image.Image] = field(default_factory=list)
    """RGB images already resized by qwen-vl-utils' rules (multiples of 28, within min/max pixels), in prompt order."""
    image_hashes: list[str] = field(default_factory=list)
    """sha256 of each resized image's raw RGB bytes + size: identical inputs have identical hashes on every backend."""
    banned_token_ids: list[int] = field(default_factory=list)
    """Token ids no backend may ever sample (image/video pad tokens...)."""
    videos: list[Video] = field(default_factory=list)
    """Videos in prompt order, one `<|video_pad|>` each in prompt_ids: frames sampled and resized once."""
    data_source: str = "unknown"
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    """Row index in its dataset (for artifacts and resume); -1 when not from a dataset."""


@dataclass
class SamplingParams:
    """Backend-independent sampling settings; each backend maps them one to one."""

    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 64
    seed: int | None = None
    """Base seed; sample i of a request uses seed + i where the backend supports it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens (the model's EOS tokens always stop). The stop token is kept in the response."""
    top_logprobs: int = 0
    """How many top-k logprobs per generated position to return (0 = only the sampled token's logprob)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RolloutResult:
    """One generated sample. Logprobs are of the RAW model distribution (log_softmax of the logits, before
    temperature/top-p/top-k), the same on every backend, so they compare with the trainer's logprobs."""

    uid: str
    """The request's uid (the group id)."""
    sample_index: int
    """0..n-1 within its request."""
    response_ids: list[int]
    response_logprobs: list[float]
    """Logprob of each sampled token; same length as response_ids."""
    finish_reason: str
    """'stop' (EOS or stop token, kept in response_ids), 'length' (max_new_tokens reached) or 'abort'."""
    top_logprobs: list[dict[int, float]] | None = None
    """Per position {token_id: logprob} of the top-k tokens when SamplingParams.top_logprobs > 0."""
    routed_experts: torch.Tensor | None = None
    """A MoE model's routing as the engine computed it, (MoE layers, tokens the engine ran: expanded prompt + response
    - 1, top-k) expert ids, when the backend captured it (`RolloutBackend.captures_routing`); else None."""
    engine: int | None = None
    """Which of the run's engines sampled it (0.. in the order the backend numbers them: colocated engine groups,
    rollout workers), when the backend has more than one engine; None with one engine. Logged as
    `mismatch/engine/<k>/*`."""


@dataclass
class PromptInputs:
    """What every sample of one request shares, computed once per request by the processor (not once per sample):
    the trainer's view of the prompt (expanded ids, position ids, image inputs)."""

    uid: str
    input_ids: torch.Tensor
    """(n,) long: the EXPANDED prompt ids (one token per merged image patch; no padding)."""
    position_ids: torch.Tensor
    """(3, n) long: the prompt's mrope ids."""
    multi_modal_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """`pixel_values` and `image_grid_thw` with images; `pixel_values_videos`, `video_grid_thw` and
    `second_per_grid_ts` with videos; empty for a text-only prompt."""
    data_source: str = "unknown"
    ground_truth: Any = None


@dataclass
class Sample:
    """One trajectory padded right where it finished (see `vlmrl.batch.padding.pad_sample`); the batch step only
    stacks."""

    uid: str
    """Group id (the request's uid); padding rows get their own unique uid."""
    prompt_ids: torch.Tensor
    """(P,) long: expanded prompt ids, LEFT-padded with the pad token."""
    response_ids: torch.Tensor
    """(R,) long: response ids, RIGHT-padded with the pad token."""
    attention_mask: torch.Tensor
    """(L,) long: 1 on real prompt and response tokens."""
    response_mask: torch.Tensor
    """(R,) float: 1 = policy token (in the loss), 0 = tool/env/padding token."""
    position_ids: torch.Tensor
    """(3, L) long: mrope (temporal, height, width) position ids, continued across the response."""
    multi_modal_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """`pixel_values` (num_patches, C*T*p*p) and `image_grid_thw` (num_images, 3); with videos `pixel_values_videos`
    (num_video_patches, C*T*p*p), `video_grid_thw` (num_videos, 3) and `second_per_grid_ts` (num_videos,); EMPTY for
    text-only and padding rows."""
    rollout_logprobs: torch.Tensor | None = None
    """(R,) float: the backend's logprobs of the response tokens (0 on padding)."""
    reward: float = 0.0
    reward_extra: dict[str, float] = field(default_factory=dict)
    """Named reward parts (accuracy, format...) logged apart."""
    is_padding: bool = False
    data_source: str = "unknown"
    ground_truth: Any = None
    finish_reason: str = "stop"
    policy_version: int = 0
    """Version of the policy that produced the response (partial rollout tags carried-over samples)."""
    engine: int | None = None
    """`RolloutResult.engine` of the response (None: one engine, or a padding row)."""
    routed_experts: torch.Tensor | None = None
    """The engine's routing of this trajectory's attended tokens (prompt + response), (MoE layers, tokens, top-k); -1
    where the engine ran none (the last response token); None when not captured."""


@dataclass
class TrainBatch:
    """Stacked samples; row i of every tensor belongs to `uids[i]`."""

    input_ids: torch.Tensor
    """(B, L) long: prompt (left-padded) + response (right-padded)."""
    attention_mask: torch.Tensor
    """(B, L) long."""
    position_ids: torch.Tensor
    """(B, 3, L) long. Transformers' Qwen2.5-VL forward wants (3, B, L): use `mrope_position_ids()`."""
    response_mask: torch.Tensor
    """(B, R) float."""
    prompt_length: int
    """P: responses start at column P of input_ids."""
    multi_modal_inputs: list[dict[str, torch.Tensor]]
    """Per row; empty dict for text-only rows and padding rows."""
    uids: list[str]
    is_padding: torch.Tensor
    """(B,) bool."""
    rewards: torch.Tensor
    """(B,) float: sequence-level reward (0 on padding rows)."""
    rollout_logprobs: torch.Tensor | None = None
    """(B, R) float."""
    data_sources: list[str] = field(default_factory=list)
    reward_extra: list[dict[str, float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    routed_experts: list[torch.Tensor | None] | None = None
    """A MoE policy's routing per row, (MoE layers, the row's attended tokens, top-k) expert ids, recorded by the
    old-logprob pass (`ActorCore.compute_logprobs(record_routing=True)`); None: not recorded (a dense model)."""
    engines: list[int] = field(default_factory=list)
    """Per row, the engine that sampled it (`RolloutResult.engine`; -1 on padding rows); empty when the run has one
    engine."""
    teacher_logprobs: torch.Tensor | None = None
    """(B, R) the distillation teacher's logprobs of the sampled tokens, set on the update's batch when
    algorithm.distill.mode=loss (the update adds the distillation loss where it is set); None otherwise."""
    teacher_topk_ids: torch.Tensor | None = None
    """(B, R, K) long: the teacher's K most likely tokens at each response position, set on the update's batch with
    algorithm.distill.estimator=forward_kl_topk (the update then reads the student's logprobs at them); else None."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """(B, R, K) the teacher's logprobs of `teacher_topk_ids` (0 on padding)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> torch.Tensor:
        """(B, R) long."""
        return self.input_ids[:, self.prompt_length :]

    def mrope_position_ids(self) -> torch.Tensor:
        """(3, B, L): the layout transformers' Qwen2.5-VL forward takes."""
        return self.position_ids.permute(1, 0, 2).contiguous()

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """The batch of the given rows (in that order), every per-row field taken along."""
        rows = list(rows)
        index = torch.as_tensor(rows, dtype=torch.long)

        def pick(values: list) -> list:
            return [values[i] for i in rows] if values else []

        return TrainBatch(
            input_ids=self.input_ids[index], attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index], response_mask=self.response_mask[index],
            prompt_length=self.prompt_length, multi_modal_inputs=pick(self.multi_modal_inputs), uids=pick(self.uids),
            is_padding=self.is_padding[index], rewards=self.rewards[index],
            rollout_logprobs=None if self.rollout_logprobs is None else self.rollout_logprobs[index],
            data_sources=pick(self.data_sources), reward_extra=pick(self.reward_extra),
            finish_reasons=pick(self.finish_reasons),
            routed_experts=None if self.routed_experts is None else pick(self.routed_experts),
            engines=pick(self.engines),
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[index],
            teacher_topk_ids=None if self.teacher_topk_ids is None else self.teacher_topk_ids[index],
            teacher_topk_logprobs=None if self.teacher_topk_logprobs is None else self.teacher_topk_logprobs[index])
