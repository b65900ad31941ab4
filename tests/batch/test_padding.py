"""Per-sample padding, stacking, the required batch multiple, padding rows and metrics without them."""

from __future__ import annotations

from dataclasses import replace

import doctest
import random
import uuid

import pytest
import torch

from tests.processors.helpers import first_difference, hf_rope_index, image_row, noise_image
from vlmrl.batch import padding
from vlmrl.batch.padding import (
    batch_metrics,
    pad_results,
    pad_sample,
    required_batch_multiple,
    scored_batch,
    stack_samples,
    upsample_to_multiple,
)
from vlmrl.processors.loading import load_processor
from vlmrl.types import PromptInputs, RolloutResult, TrainBatch

P, R = 64, 12
PAD, EOS = 805, 804


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(tiny_model_path)


@pytest.fixture(scope="module")
def image_prompt(processor):
    request = processor.build_request(image_row("<image>left <image>right: same?", [
        noise_image(150, 90, seed=1), noise_image(60, 120, seed=2)]), index=0)
    return processor.prompt_inputs(request)


def _text_prompt(uid: str, n: int = 3) -> PromptInputs:
    ids = torch.arange(100, 100 + n)
    return PromptInputs(uid, ids, torch.arange(n).expand(3, n).clone())


def _text_batch(num_rows: int, group: int = 4) -> TrainBatch:
    samples = []
    for i in range(num_rows):
        sample = pad_sample(_text_prompt(f"u{i // group}"), [7] * (1 + i % 3) + [EOS], prompt_length=4,
                            response_length=5, pad_token_id=PAD, rollout_logprobs=[-0.5] * (2 + i % 3))
        sample.reward = float(i % 5)
        samples.append(sample)
    return stack_samples(samples)


def test_docstring_examples_hold():
    failures, tried = doctest.testmod(padding)
    assert tried > 0 and failures == 0


def test_sample_layout(image_prompt):
    response = [11, 12, 13, EOS]
    sample = pad_sample(image_prompt, response, prompt_length=P, response_length=R, pad_token_id=PAD,
                        rollout_logprobs=[-0.1, -0.2, -0.3, -0.4], finish_reason="stop")
    n = image_prompt.input_ids.shape[0]
    assert sample.prompt_ids.shape == (P,) and sample.response_ids.shape == (R,)
    assert sample.prompt_ids[: P - n].eq(PAD).all() and torch.equal(sample.prompt_ids[P - n:], image_prompt.input_ids)
    assert sample.response_ids[:4].tolist() == response and sample.response_ids[4:].eq(PAD).all()
    assert sample.attention_mask.tolist() == [0] * (P - n) + [1] * (n + 4) + [0] * (R - 4)
    assert sample.response_mask.tolist() == [1.0] * 4 + [0.0] * (R - 4)
    assert sample.rollout_logprobs[:4].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert sample.rollout_logprobs[4:].eq(0).all()
    assert sample.position_ids.shape == (3, P + R)
    last = int(image_prompt.position_ids.max())
    assert sample.position_ids[:, P: P + 4].tolist() == [list(range(last + 1, last + 5))] * 3
    assert sample.multi_modal_inputs is image_prompt.multi_modal_inputs  # shared by all samples, not copied
    assert sample.uid == image_prompt.uid


def test_sample_position_ids_equal_transformers_over_prompt_and_response(processor, image_prompt, tiny_model_path):
    """Continuing text positions across the response is exactly what get_rope_index gives for the whole row."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_path)
    text_prompt = processor.prompt_inputs(processor.build_request({"prompt": "no image here"}))
    samples = [pad_sample(image_prompt, [21, 22, 23, 24, 25, EOS], prompt_length=P, response_length=R,
                          pad_token_id=PAD),
               pad_sample(text_prompt, [31, EOS], prompt_length=P, response_length=R, pad_token_id=PAD)]
    batch = stack_samples(samples)
    grid = image_prompt.multi_modal_inputs["image_grid_thw"]
    expected = hf_rope_index(hf_model, batch.input_ids, batch.attention_mask, grid, processor.image_token_id)
    assert torch.equal(expected, batch.mrope_position_ids()), first_difference(expected, batch.mrope_position_ids())


def test_multi_turn_response_mask_is_kept(image_prompt):
    mask = [1, 1, 0, 0, 0, 1, 1]  # policy, tool output, policy
    sample = pad_sample(image_prompt, list(range(50, 57)), prompt_length=P, response_length=R, pad_token_id=PAD,
                        response_mask=mask)
    assert sample.response_mask.tolist() == mask + [0.0] * (R - 7)
    assert sample.attention_mask[P: P + 7].eq(1).all()  # tool tokens are attended, just not trained on
    with pytest.raises(ValueError, match="response_mask has 3 values for 7 response tokens"):
        pad_sample(image_prompt, list(range(50, 57)), prompt_length=P, response_length=R, pad_token_id=PAD,
                   response_mask=[1, 1, 0])


def test_explicit_position_ids_for_responses_with_images(image_prompt):
    n = image_prompt.input_ids.shape[0]
    full = torch.arange(3 * (n + 2)).view(3, n + 2)
    sample = pad_sample(image_prompt, [1, 2], prompt_length=P, response_length=R, pad_token_id=PAD,
                        position_ids=full)
    assert torch.equal(sample.position_ids[:, P - n: P + 2], full)
    with pytest.raises(ValueError, match=r"position_ids \(3, 5\)"):
        pad_sample(image_prompt, [1, 2], prompt_length=P, response_length=R, pad_token_id=PAD,
                   position_ids=torch.zeros(3, 5, dtype=torch.long))


def test_overlong_prompt_or_response_raises_never_truncates(image_prompt):
    n = image_prompt.input_ids.shape[0]
    with pytest.raises(ValueError, match=f"prompt has {n} tokens > prompt_length={n - 1}"):
        pad_sample(image_prompt, [1], prompt_length=n - 1, response_length=R, pad_token_id=PAD)
    with pytest.raises(ValueError, match=f"response has {R + 1} tokens > response_length={R}"):
        pad_sample(image_prompt, [1] * (R + 1), prompt_length=P, response_length=R, pad_token_id=PAD)


def test_stack_needs_one_layout():
    a = pad_sample(_text_prompt("a"), [1], prompt_length=4, response_length=5, pad_token_id=PAD)
    b = pad_sample(_text_prompt("b"), [1], prompt_length=6, response_length=5, pad_token_id=PAD)
    with pytest.raises(ValueError, match="sample b is padded to P=6, R=5 but the first sample to P=4, R=5"):
        stack_samples([a, b])


def test_stacked_batch_shapes():
    batch = _text_batch(6)
    assert batch.input_ids.shape == (6, 9) and batch.position_ids.shape == (6, 3, 9)
    assert batch.mrope_position_ids().shape == (3, 6, 9) and batch.response_ids.shape == (6, 5)
    assert batch.rollout_logprobs.shape == (6, 5) and batch.rewards.tolist() == [0, 1, 2, 3, 4, 0]


def test_dp2_45_prompts_minibatch15_n8():
    multiple = required_batch_multiple(dp_size=2, ppo_mini_batch_size=15, rollout_n=8)
    assert multiple == 120
    assert 45 * 8 % multiple == 0  # the full batch needs no padding row
    batch = _text_batch(45 * 8 - 3)  # three samples lost (filtered / aborted): 357 rows
    padded = upsample_to_multiple(batch, multiple, eos_token_id=EOS, pad_token_id=PAD)
    assert len(padded) == 360 and int(padded.is_padding.sum()) == 3
    per_rank, mini_per_rank = len(padded) // 2, 15 * 8 // 2
    assert per_rank * 2 == len(padded) and per_rank % mini_per_rank == 0  # 180 rows per rank = 3 mini-batches of 60
    assert upsample_to_multiple(_text_batch(360), multiple, eos_token_id=EOS, pad_token_id=PAD).is_padding.sum() == 0


def test_randomized_combinations_upsample_to_a_valid_multiple():
    rng = random.Random(0)
    checked, base = 0, _text_batch(1200)
    for _ in range(300):
        dp, mini, n = rng.choice([1, 2, 3, 4, 6, 8, 16]), rng.randint(1, 40), rng.choice([1, 2, 4, 5, 8, 16])
        size = mini * n
        if size % dp:
            with pytest.raises(ValueError, match="cannot split over"):
                required_batch_multiple(dp, mini, n)
            continue
        multiple = required_batch_multiple(dp, mini, n)
        smallest = next(m for m in range(size, multiple + 1, size) if m % dp == 0)
        assert multiple == smallest
        if multiple <= 600 and checked < 40:
            rows = rng.randint(1, 2 * multiple)
            padded = upsample_to_multiple(stack_samples_subset(base, slice(0, rows)), multiple,
                                          eos_token_id=EOS, pad_token_id=PAD)
            assert len(padded) % multiple == 0 and len(padded) - rows < multiple
            assert int(padded.is_padding.sum()) == len(padded) - rows
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("bad", [dict(dp_size=0), dict(rollout_n=-1), dict(ppo_mini_batch_size=1.5)])
def test_required_multiple_rejects_nonsense(bad):
    args = dict(dp_size=2, ppo_mini_batch_size=4, rollout_n=2) | bad
    with pytest.raises(ValueError, match="must be a positive integer"):
        required_batch_multiple(**args)


def test_padding_rows_layout(image_prompt):
    real = stack_samples([pad_sample(image_prompt, [5, EOS], prompt_length=P, response_length=R, pad_token_id=PAD,
                                     rollout_logprobs=[-1.0, -2.0])] * 3)
    real.rewards[:] = 1.0
    padded = upsample_to_multiple(real, 8, eos_token_id=EOS, pad_token_id=PAD)
    assert len(padded) == 8
    for row in range(3, 8):
        assert padded.is_padding[row] and padded.multi_modal_inputs[row] == {}
        assert padded.attention_mask[row].nonzero().flatten().tolist() == [P - 1, P]  # 1 prompt + 1 response token
        assert padded.input_ids[row, P - 1] == EOS and padded.input_ids[row, P] == EOS
        assert padded.position_ids[row].shape == padded.position_ids[0].shape == (3, P + R)
        assert padded.position_ids[row, :, P - 1].tolist() == [0, 0, 0]
        assert padded.position_ids[row, :, P].tolist() == [1, 1, 1]
        assert padded.response_mask[row].eq(0).all() and padded.rewards[row] == 0
        assert padded.rollout_logprobs[row].eq(0).all()
    assert torch.equal(padded.input_ids[:3], real.input_ids)
    assert padded.multi_modal_inputs[:3] == real.multi_modal_inputs
    assert upsample_to_multiple(real, 3, eos_token_id=EOS, pad_token_id=PAD) is real


def test_padding_uids_are_unique_and_never_collide(monkeypatch):
    batch = _text_batch(5)
    colliding = uuid.UUID(int=1)
    batch.uids[0] = f"{padding.PADDING_UID_PREFIX}{colliding.hex}"  # a real row that looks like a padding row
    drawn = iter([colliding, colliding, uuid.UUID(int=2), uuid.UUID(int=2), uuid.UUID(int=3), uuid.UUID(int=4)])
    monkeypatch.setattr(padding.uuid, "uuid4", lambda: next(drawn))
    padded = upsample_to_multiple(batch, 8, eos_token_id=EOS, pad_token_id=PAD)
    pad_uids = padded.uids[5:]
    assert padded.uids[:5] == batch.uids
    assert len(set(pad_uids)) == 3 and not set(pad_uids) & set(batch.uids)


def test_metrics_ignore_padding_rows():
    batch = _text_batch(10)
    batch.reward_extra = [{"accuracy": float(i % 2)} for i in range(10)]
    padded = upsample_to_multiple(batch, 16, eos_token_id=EOS, pad_token_id=PAD)
    assert batch_metrics(padded) == {**batch_metrics(batch), "batch/padding_rows": 6.0}
    assert batch_metrics(batch)["reward/mean"] == pytest.approx(float(batch.rewards.mean()))
    assert batch_metrics(batch)["reward_extra/accuracy/mean"] == 0.5


def test_all_padding_batch_yields_no_metric_values_but_counts_its_rows_and_says_so(caplog):
    only_padding = upsample_to_multiple(_text_batch(1), 4, eos_token_id=EOS, pad_token_id=PAD)
    only_padding = stack_samples_subset(only_padding, slice(1, 4))
    with caplog.at_level("WARNING", logger="vlmrl.batch.padding"):
        # no reward or length made of padding, but the dashboard shows a step without a real row
        assert batch_metrics(only_padding) == {"batch/real_rows": 0.0, "batch/padding_rows": 3.0}
    assert "only padding rows (3)" in caplog.text


def stack_samples_subset(batch, rows: slice):
    """Rows of a batch as a batch (the trainer's mini-batch split does the same)."""
    return TrainBatch(
        input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
        position_ids=batch.position_ids[rows], response_mask=batch.response_mask[rows],
        prompt_length=batch.prompt_length, multi_modal_inputs=batch.multi_modal_inputs[rows],
        uids=batch.uids[rows], is_padding=batch.is_padding[rows], rewards=batch.rewards[rows],
    )


def test_results_are_padded_per_request_then_scored_stacked_and_filled_to_the_multiple():
    prompts = [_text_prompt("a", n=2), _text_prompt("b", n=3)]
    results = [RolloutResult(uid, k, [7] * (k + 1) + [EOS], [-0.25] * (k + 2), "stop")
               for uid in ("a", "b") for k in range(2)]
    samples = pad_results(prompts, results, prompt_length=4, response_length=5, pad_token_id=PAD, policy_version=3)
    assert [s.uid for s in samples] == ["a", "a", "b", "b"]
    assert [int(s.attention_mask.sum()) for s in samples] == [2 + 2, 2 + 3, 3 + 2, 3 + 3]
    assert all(s.policy_version == 3 and s.rollout_logprobs is not None for s in samples)
    # an agent sample arrives with its tools' own rewards in reward_extra: the task's parts are added next to them
    samples[0].reward_extra["tool/echo"] = 0.5
    parts = [{"accuracy": float(i % 2)} for i in range(4)]
    batch = scored_batch(samples, [0.0, 1.0, 0.0, 1.0], parts, multiple=required_batch_multiple(2, 3, 2),
                         eos_token_id=EOS, pad_token_id=PAD)
    assert len(batch) == 6 and batch.is_padding.tolist() == [False] * 4 + [True] * 2
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert batch.reward_extra[:2] == [{"tool/echo": 0.5, "accuracy": 0.0}, {"accuracy": 1.0}]
    assert batch.engines == [], "one engine: no per-row engine list"
    # two engines (numbered by the backend): each row keeps its engine, the padding rows get -1
    two = pad_results(prompts, [replace(r, engine=i // 2) for i, r in enumerate(results)], prompt_length=4,
                      response_length=5, pad_token_id=PAD, policy_version=3)
    batch = scored_batch(two, [0.0] * 4, [{}] * 4, multiple=6, eos_token_id=EOS, pad_token_id=PAD)
    assert batch.engines == [0, 0, 1, 1, -1, -1]
    with pytest.raises(ValueError, match="3 results for 2 prompts"):
        pad_results(prompts, results[:3], prompt_length=4, response_length=5, pad_token_id=PAD, policy_version=0)
    with pytest.raises(ValueError, match="4 samples, 3 rewards"):
        scored_batch(samples, [0.0] * 3, parts, multiple=1, eos_token_id=EOS, pad_token_id=PAD)
