"""The VLM batch layout: per-sample padding as each sample finishes, stacking, padding rows, metrics without them.

Layout of one row (P = prompt_length, R = response_length, L = P + R, both FIXED by the config so that every
sample, every rank and every step has the same shape; ranks padded to different lengths cannot be gathered):

    input_ids       [pad ... pad | prompt (expanded) | response | pad ... pad]
    attention_mask  [0   ...   0 | 1             ... 1 | 0   ...   0]
    position_ids    (3, L) mrope ids: transformers' get_rope_index layout, 0 on padding, the response continuing
                    the prompt's text positions (+1 per token)
    response_mask   (R,) 1 = policy token (in the loss), 0 = tool/env token or padding

Padding rows (for divisibility by dp size and mini-batch sizes) are synthetic: one prompt token, one EOS response
token, their own uid, `is_padding`, EMPTY multi_modal_inputs, (3, L) position ids, response_mask 0, reward 0. They add
nothing to any loss, gradient, advantage or metric; duplicated real rows would join their GRPO groups' statistics,
the gradients and the metrics.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence

import torch

from vlmrl.types import PromptInputs, RolloutResult, Sample, TrainBatch

logger = logging.getLogger(__name__)

PADDING_UID_PREFIX = "padding-"
PADDING_SOURCE = "padding"


def pad_sample(
    prompt: PromptInputs,
    response_ids: Sequence[int] | torch.Tensor,
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    response_mask: Sequence[float] | torch.Tensor | None = None,
    rollout_logprobs: Sequence[float] | torch.Tensor | None = None,
    finish_reason: str = "stop",
    policy_version: int = 0,
    position_ids: torch.Tensor | None = None,
    multi_modal_inputs: dict[str, torch.Tensor] | None = None,
) -> Sample:
    """Pad one finished sample to the fixed (P, R) layout, so that the batch step only stacks.

    Args:
        prompt: the request's shared inputs (`prompt_inputs`).
        response_ids: (r,) generated ids (the stop token kept), r <= response_length.
        prompt_length, response_length: P and R; a longer prompt or response raises, it is never truncated.
        response_mask: (r,) 1 = policy token, 0 = tool/env token (multi-turn); None = all policy tokens.
        rollout_logprobs: (r,) the backend's logprobs of the response tokens.
        position_ids: (3, n + r) mrope ids of the whole unpadded sequence, for a response that holds images
            (multi-turn with image observations; compute them with `Processor.position_ids`). None = the prompt's
            ids continued by text positions (+1 per response token), what get_rope_index gives for a text response.
        multi_modal_inputs: replaces the prompt's (a response with images adds its own); None = the prompt's.

    Returns:
        A Sample with prompt_ids (P,), response_ids (R,), attention_mask (L,), response_mask (R,),
        position_ids (3, L), rollout_logprobs (R,) or None.
    """
    n, p_len, r_len = prompt.input_ids.shape[0], prompt_length, response_length
    response = torch.as_tensor(response_ids, dtype=torch.long).reshape(-1)
    r = response.shape[0]
    if n > p_len:
        raise ValueError(f"sample {prompt.uid}: prompt has {n} tokens > prompt_length={p_len} (never truncated: "
                         "the processor filters overlong prompts; raise max_prompt_length)")
    if r > r_len:
        raise ValueError(f"sample {prompt.uid}: response has {r} tokens > response_length={r_len}; cap generation "
                         "at response_length (max_new_tokens, and the agent loop's total)")

    prompt_ids = torch.full((p_len,), pad_token_id, dtype=torch.long)
    prompt_ids[p_len - n:] = prompt.input_ids
    padded_response = torch.full((r_len,), pad_token_id, dtype=torch.long)
    padded_response[:r] = response
    attention_mask = torch.zeros(p_len + r_len, dtype=torch.long)
    attention_mask[p_len - n: p_len + r] = 1
    mask = torch.zeros(r_len, dtype=torch.float32)
    mask[:r] = 1.0 if response_mask is None else _checked_len(response_mask, r, "response_mask", prompt.uid)

    positions = torch.zeros(3, p_len + r_len, dtype=torch.long)
    if position_ids is None:
        positions[:, p_len - n: p_len] = prompt.position_ids
        start = int(prompt.position_ids.max()) + 1 if n else 0
        positions[:, p_len: p_len + r] = torch.arange(start, start + r)
    else:
        if tuple(position_ids.shape) != (3, n + r):
            raise ValueError(f"sample {prompt.uid}: position_ids {tuple(position_ids.shape)} != (3, {n + r})")
        positions[:, p_len - n: p_len + r] = position_ids

    logprobs = None
    if rollout_logprobs is not None:
        logprobs = torch.zeros(r_len, dtype=torch.float32)
        logprobs[:r] = _checked_len(rollout_logprobs, r, "rollout_logprobs", prompt.uid)
    return Sample(
        uid=prompt.uid, prompt_ids=prompt_ids, response_ids=padded_response, attention_mask=attention_mask,
        response_mask=mask, position_ids=positions,
        multi_modal_inputs=prompt.multi_modal_inputs if multi_modal_inputs is None else multi_modal_inputs,
        rollout_logprobs=logprobs, data_source=prompt.data_source, ground_truth=prompt.ground_truth,
        finish_reason=finish_reason, policy_version=policy_version,
    )


def _checked_len(values: Sequence[float] | torch.Tensor, expected: int, name: str, uid: str) -> torch.Tensor:
    tensor = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    if tensor.shape[0] != expected:
        raise ValueError(f"sample {uid}: {name} has {tensor.shape[0]} values for {expected} response tokens")
    return tensor


def stack_samples(samples: Sequence[Sample]) -> TrainBatch:
    """Stack padded samples (all with the same P and R) into a TrainBatch; row i is samples[i]."""
    if not samples:
        raise ValueError("stack_samples needs at least one sample")
    p_len, r_len = samples[0].prompt_ids.shape[0], samples[0].response_ids.shape[0]
    for s in samples:
        if s.prompt_ids.shape[0] != p_len or s.response_ids.shape[0] != r_len:
            raise ValueError(f"sample {s.uid} is padded to P={s.prompt_ids.shape[0]}, R={s.response_ids.shape[0]} "
                             f"but the first sample to P={p_len}, R={r_len}: pad every sample to the configured sizes")
    with_logprobs = [s.rollout_logprobs is not None for s in samples]
    if any(with_logprobs) and not all(with_logprobs):
        raise ValueError("some samples carry rollout_logprobs and others do not: all or none")
    return TrainBatch(
        input_ids=torch.cat([torch.stack([s.prompt_ids for s in samples]),
                             torch.stack([s.response_ids for s in samples])], dim=1),
        attention_mask=torch.stack([s.attention_mask for s in samples]),
        position_ids=torch.stack([s.position_ids for s in samples]),
        response_mask=torch.stack([s.response_mask for s in samples]),
        prompt_length=p_len,
        multi_modal_inputs=[s.multi_modal_inputs for s in samples],
        uids=[s.uid for s in samples],
        is_padding=torch.tensor([s.is_padding for s in samples], dtype=torch.bool),
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        rollout_logprobs=torch.stack([s.rollout_logprobs for s in samples]) if all(with_logprobs) else None,
        data_sources=[s.data_source for s in samples],
        reward_extra=[dict(s.reward_extra) for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        routed_experts=([s.routed_experts for s in samples] if any(s.routed_experts is not None for s in samples)
                        else None),
        engines=([-1 if s.engine is None else s.engine for s in samples]
                 if any(s.engine is not None for s in samples) else []),
    )


def required_batch_multiple(dp_size: int, ppo_mini_batch_size: int, rollout_n: int) -> int:
    """The number of samples a training batch must be a multiple of: lcm of the dp size and the global mini-batch
    size in samples (mini-batch size in prompts x rollout.n).

    Raises ValueError when a mini-batch cannot split evenly over the dp ranks (uneven ranks hang collectives).

    >>> required_batch_multiple(dp_size=2, ppo_mini_batch_size=15, rollout_n=8)
    120
    """
    for name, value in (("dp_size", dp_size), ("ppo_mini_batch_size", ppo_mini_batch_size), ("rollout_n", rollout_n)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name}={value}: must be a positive integer")
    samples = ppo_mini_batch_size * rollout_n
    if samples % dp_size:
        raise ValueError(f"ppo_mini_batch_size x rollout.n = {samples} samples cannot split over {dp_size} "
                         "data-parallel ranks: choose ppo_mini_batch_size so that ppo_mini_batch_size x rollout.n is "
                         f"a multiple of {dp_size}")
    return math.lcm(dp_size, samples)


def upsample_to_multiple(batch: TrainBatch, multiple: int, *, eos_token_id: int, pad_token_id: int) -> TrainBatch:
    """Append padding rows until len(batch) is a multiple of `multiple` (`required_batch_multiple`).

    A padding row: prompt = one EOS token (last prompt column), response = one EOS token (first response column),
    attention on those two, position ids (3, L) = 0 and 1 there (0 elsewhere, as for any padding), response_mask 0,
    reward 0, rollout logprobs 0, EMPTY multi_modal_inputs, is_padding True, and a fresh uid that no real row has.
    Returns the batch itself when no row is needed.
    """
    if multiple < 1:
        raise ValueError(f"multiple={multiple}: must be >= 1")
    missing = (-len(batch)) % multiple
    if missing == 0:
        return batch
    p_len = batch.prompt_length
    length = batch.input_ids.shape[1]
    if p_len < 1 or length - p_len < 1:
        raise ValueError(f"padding rows need P >= 1 and R >= 1, got P={p_len}, R={length - p_len}")
    input_ids = torch.full((missing, length), pad_token_id, dtype=batch.input_ids.dtype)
    input_ids[:, p_len - 1: p_len + 1] = eos_token_id
    attention_mask = torch.zeros(missing, length, dtype=batch.attention_mask.dtype)
    attention_mask[:, p_len - 1: p_len + 1] = 1
    position_ids = torch.zeros(missing, batch.position_ids.shape[1], length, dtype=batch.position_ids.dtype)
    position_ids[:, :, p_len] = 1  # the response token follows the prompt token at position 0
    taken = set(batch.uids)
    uids = []
    while len(uids) < missing:
        uid = f"{PADDING_UID_PREFIX}{uuid.uuid4().hex}"
        if uid not in taken:
            taken.add(uid)
            uids.append(uid)

    def cat(real: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return torch.cat([real, pad.to(real.dtype)], dim=0)

    zeros_r = torch.zeros(missing, length - p_len)
    return TrainBatch(
        input_ids=cat(batch.input_ids, input_ids),
        attention_mask=cat(batch.attention_mask, attention_mask),
        position_ids=cat(batch.position_ids, position_ids),
        response_mask=cat(batch.response_mask, zeros_r),
        prompt_length=p_len,
        multi_modal_inputs=list(batch.multi_modal_inputs) + [{} for _ in range(missing)],
        uids=list(batch.uids) + uids,
        is_padding=cat(batch.is_padding, torch.ones(missing, dtype=torch.bool)),
        rewards=cat(batch.rewards, torch.zeros(missing)),
        rollout_logprobs=None if batch.rollout_logprobs is None else cat(batch.rollout_logprobs, zeros_r),
        # optional per-row lists stay empty when the batch did not fill them
        data_sources=list(batch.data_sources) + [PADDING_SOURCE] * missing if batch.data_sources else [],
        reward_extra=list(batch.reward_extra) + [{} for _ in range(missing)] if batch.reward_extra else [],
        finish_reasons=list(batch.finish_reasons) + [PADDING_SOURCE] * missing if batch.finish_reasons else [],
        routed_experts=None if batch.routed_experts is None else list(batch.routed_experts) + [None] * missing,
        engines=list(batch.engines) + [-1] * missing if batch.engines else [],
    )


def pad_results(prompts: Sequence[PromptInputs], results: Sequence[RolloutResult], *, prompt_length: int,
                response_length: int, pad_token_id: int, policy_version: int) -> list[Sample]:
    """Pad every result of a plain (single-turn) rollout: results are request-major, len(results) // len(prompts)
    per request, and prompts[j] holds request j's shared inputs (`prompt_inputs`, computed once per request)."""
    if not prompts or len(results) % len(prompts):
        raise ValueError(f"{len(results)} results for {len(prompts)} prompts: need the same number per prompt")
    n = len(results) // len(prompts)
    samples = [pad_sample(prompts[i // n], result.response_ids, prompt_length=prompt_length,
                          response_length=response_length, pad_token_id=pad_token_id,
                          rollout_logprobs=result.response_logprobs, finish_reason=result.finish_reason,
                          policy_version=policy_version)
               for i, result in enumerate(results)]
    for sample, result in zip(samples, results):
        sample.engine = result.engine
        if result.routed_experts is not None:
            sample.routed_experts = engine_routing_of(result.routed_experts, int(sample.attention_mask.sum()))
    return samples


def engine_routing_of(routing: torch.Tensor, tokens: int) -> torch.Tensor:
    """An engine's routing (the tokens it ran: prompt + response - 1) fitted to a row's `tokens` attended tokens:
    cut where the row's response was cut, -1 (route as the trainer's own router says) where the engine ran none."""
    routing = routing[:, :tokens].to(torch.long)
    missing = tokens - routing.shape[1]
    if missing > 0:
        routing = torch.cat([routing, routing.new_full((routing.shape[0], missing, routing.shape[2]), -1)], dim=1)
    return routing


def scored_batch(samples: Sequence[Sample], rewards: Sequence[float], reward_parts: Sequence[dict[str, float]], *,
                 multiple: int, eos_token_id: int, pad_token_id: int) -> TrainBatch:
    """The batch a step trains on, from its padded samples (plain or multi-turn) and their scores: sample i gets
    rewards[i] and reward_parts[i] (added to its reward_extra, which keeps what the agent's tools put there), then
    the samples are stacked and padding rows appended up to a multiple of `multiple` (`required_batch_multiple`)."""
    if not len(samples) == len(rewards) == len(reward_parts):
        raise ValueError(f"{len(samples)} samples, {len(rewards)} rewards and {len(reward_parts)} reward parts: "
                         "need one score per sample")
    for sample, reward, parts in zip(samples, rewards, reward_parts):
        sample.reward = float(reward)
        sample.reward_extra.update(parts)
    return upsample_to_multiple(stack_samples(samples), multiple, eos_token_id=eos_token_id,
                                pad_token_id=pad_token_id)


# ---------------------------------------------------------------- metrics that never see padding rows


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Reward and length metrics over the REAL rows of a batch. Keys: reward/{mean,std,max,min},
    reward/<data_source>/mean, reward_extra/<name>/mean, response_length/{mean,max,min,clip_ratio},
    prompt_length/mean, batch/{real_rows,padding_rows}. A batch of only padding rows has no reward or length to
    report (logged): only batch/real_rows = 0 and batch/padding_rows, so that it shows on the dashboard too."""
    real = ~batch.is_padding.to(torch.bool)
    num_real = int(real.sum())
    if num_real == 0:
        logger.warning("metrics skipped: the batch holds only padding rows (%d)", len(batch))
        return {"batch/real_rows": 0.0, "batch/padding_rows": float(len(batch))}
    rewards = batch.rewards[real].float()
    p_len = batch.prompt_length
    response_len = batch.attention_mask[real, p_len:].sum(-1).float()
    prompt_len = batch.attention_mask[real, :p_len].sum(-1).float()
    rows = real.nonzero(as_tuple=True)[0].tolist()
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(response_len.mean()),
        "response_length/max": float(response_len.max()),
        "response_length/min": float(response_len.min()),
        "prompt_length/mean": float(prompt_len.mean()),
        "batch/real_rows": float(num_real),
        "batch/padding_rows": float(len(batch) - num_real),
    }
    if batch.finish_reasons:
        metrics["response_length/clip_ratio"] = sum(batch.finish_reasons[i] == "length" for i in rows) / num_real
    for key, picked in _grouped_means(batch, rows).items():
        metrics[key] = picked
    return metrics


def _grouped_means(batch: TrainBatch, rows: list[int]) -> dict[str, float]:
    """Per data source reward means and per named reward part means, over the given (real) rows."""
    sums: dict[str, list[float]] = {}
    for i in rows:
        if batch.data_sources:
            sums.setdefault(f"reward/{batch.data_sources[i]}/mean", []).append(float(batch.rewards[i]))
        if batch.reward_extra:
            for name, value in batch.reward_extra[i].items():
                sums.setdefault(f"reward_extra/{name}/mean", []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sums.items()}
