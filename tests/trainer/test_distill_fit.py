"""On-policy distillation in the trainer (algorithm.distill): the teacher refused before anything starts when it
reads ids otherwise than the student; the teacher's logprobs of the student's own rows equal a plain transformers
forward of the teacher; one-step fits (the hf backend) log the distill/* metrics, and a teacher equal to the student
moves nothing. The demo's trained model teaching a fresh tiny model is tests/trainer/test_demo_learns.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.batches import make_batch
from tests.trainer.test_fit import base_args
from vlmrl.actor.config import ActorConfig
from vlmrl.actor.forward import micro_batch
from vlmrl.actor.local import Actor
from vlmrl.algorithms.config import DistillConfig
from vlmrl.algorithms.distill import distill_advantages
from vlmrl.config import ConfigError, load_config
from vlmrl.models.families import family_of
from vlmrl.processors.teacher import teacher_refusal
from vlmrl.train import main
from vlmrl.trainer.fit import fit

ONE_STEP = ("trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1")


def test_a_teacher_of_another_family_is_refused_with_one_error_line(tmp_path, capsys):
    """GLM-4.1V cannot score a Qwen2.5-VL student's ids: the run stops at its config (exit 2, no engine, no
    model loaded) with one line naming both models and what differs."""
    args = base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-glm4v")
    with pytest.raises(ConfigError, match="family differs"):
        load_config(args)
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: algorithm.distill.teacher=tiny-glm4v "), err
    assert "actor.model_path=tiny" in err[0] and "GLM-4.1V" in err[0] and "Qwen2.5-VL" in err[0], err


def _student_copy(student: str, folder: Path) -> Path:
    """The student's config, tokenizer and processor files (no weights: the check reads none) in `folder`."""
    folder.mkdir()
    for file in Path(student).iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    return folder


def test_a_teacher_with_other_image_token_ids_is_refused(tiny_model_path, tmp_path):
    """Same family and tokenizer, but the image placeholder is another id: the teacher would read the student's
    image tokens as text."""
    teacher = _student_copy(tiny_model_path, tmp_path / "teacher")
    config = json.loads((teacher / "config.json").read_text())
    config["image_token_id"] += 1
    (teacher / "config.json").write_text(json.dumps(config))
    refusal = teacher_refusal(tiny_model_path, str(teacher))
    assert refusal is not None and "image_token_id differs" in refusal and str(teacher) in refusal, refusal


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_path, tmp_path):
    """Same family and image tokens, one token more in the tokenizer: ids past the student's mean other text."""
    from transformers import AutoTokenizer

    teacher = _student_copy(tiny_model_path, tmp_path / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<a_teacher_only_token>"])
    tokenizer.save_pretrained(teacher)
    refusal = teacher_refusal(tiny_model_path, str(teacher))
    assert refusal is not None and "tokenizer vocabulary differs" in refusal, refusal
    assert teacher_refusal(tiny_model_path, str(_student_copy(tiny_model_path, tmp_path / "same"))) is None


def test_another_size_of_the_family_may_teach(tmp_path):
    config = load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large"))
    assert config.algorithm.distill.enabled


def test_the_teachers_logprobs_are_a_plain_forward_of_the_teacher_on_the_students_rows(tiny_model_path, processor,
                                                                                         synthetic_rows):
    """The trainer-side teacher (tiny-large, another size of the student's family) scores the student's TrainBatch
    rows (the same expanded ids, pixel values, grids and position ids): equal to the teacher's full logits, one row
    at a time, log-softmaxed at the sampled tokens; the per-token advantage is then -(log p_s - log p_t) of the two
    models' logits. float64: equal up to summation order."""
    config = ActorConfig(model_path=tiny_model_path, dtype="float64", compute_dtype="float64",
                         ppo_micro_batch_size_per_gpu=4)
    actor = Actor(config, total_steps=1, mini_batch_samples=4,
                  distill=DistillConfig(teacher="tiny-large", teacher_dtype="float64"))
    batch = make_batch(processor, synthetic_rows[:1], n=2, response_length=4)
    student, _ = actor.compute_logprobs(batch)
    teacher, _ = actor.compute_logprobs(batch, teacher=True)

    def direct(model: torch.nn.Module) -> torch.Tensor:
        out = torch.zeros_like(teacher)
        for row in range(len(batch)):
            mb = micro_batch(batch, [row], actor.device)
            inputs = family_of(model.config).inputs.forward_inputs(dict(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                pixel_values=mb.pixel_values.to(torch.float64), image_grid_thw=mb.image_grid_thw))
            with torch.no_grad():
                logits = model(**inputs, use_cache=False).logits[0, -mb.response_width - 1:-1]
            tokens = mb.input_ids[0, -mb.response_width:]
            out[row, :mb.response_width] = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        return out * batch.response_mask

    assert actor.teacher.config.text_config.hidden_size != actor.model.config.text_config.hidden_size
    torch.testing.assert_close(teacher, direct(actor.teacher), rtol=0, atol=1e-10)
    torch.testing.assert_close(student, direct(actor.model), rtol=0, atol=1e-10)
    advantages = distill_advantages(student, teacher, batch.response_mask)
    torch.testing.assert_close(advantages, -(direct(actor.model) - direct(actor.teacher)), rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["advantage", "loss"])
def test_a_teacher_equal_to_the_student_logs_zero_reverse_kl_and_moves_nothing(tmp_path, mode):
    """Pure distillation (reward_weight 0) from the student itself, one optimizer step (the batch is one
    mini-batch): the teacher's logprobs are the student's, so reverse KL, advantages and (k3) loss and its gradient
    are 0 and the policy does not move (actor/grad_norm 0)."""
    extra = ("algorithm.distill.estimator=k3",) if mode == "loss" else ()
    metrics = fit(load_config(base_args(
        "tiny", tmp_path / "run", *ONE_STEP, "actor.ppo_mini_batch_size=4", "algorithm.distill.teacher=tiny",
        f"algorithm.distill.mode={mode}", "algorithm.distill.reward_weight=0", *extra)))
    assert metrics["distill/reverse_kl"] == 0.0
    assert metrics["distill/teacher_logprob"] == metrics["distill/student_logprob"] < 0
    assert metrics["actor/grad_norm"] == 0.0
    assert "timing/teacher_logprobs" in metrics
    if mode == "loss":
        assert metrics["distill/loss"] == 0.0


def test_a_fit_with_another_teacher_and_the_reward_logs_the_distill_metrics(tmp_path):
    """tiny-large teaches tiny beside the reward, k1 loss mode, two optimizer steps: every distill/* metric is
    logged in the step's line."""
    from vlmrl.trainer.metrics import read_metrics

    out = tmp_path / "run"
    fit(load_config(base_args("tiny", out, *ONE_STEP, "algorithm.distill.teacher=tiny-large",
                              "algorithm.distill.mode=loss", "algorithm.distill.coef=0.5")))
    row = read_metrics(out / "metrics.jsonl")[-1]
    for key in ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob", "distill/loss"):
        assert key in row and torch.isfinite(torch.tensor(row[key])), key
    assert row["distill/teacher_logprob"] != row["distill/student_logprob"]


def _full_logprobs(actor: Actor, model: torch.nn.Module, batch) -> torch.Tensor:
    """(B, R, V) log_softmax of `model`'s logits at every response position, one row at a time (float64), 0 after
    each row's response: the whole distributions the top-k functions read from."""
    width = batch.response_mask.shape[1]
    out = None
    for row in range(len(batch)):
        mb = micro_batch(batch, [row], actor.device)
        inputs = family_of(model.config).inputs.forward_inputs(dict(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
            pixel_values=None if mb.pixel_values is None else mb.pixel_values.to(torch.float64),
            image_grid_thw=mb.image_grid_thw))
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[0, -mb.response_width - 1:-1]
        if out is None:
            out = torch.zeros(len(batch), width, logits.shape[-1], dtype=torch.float64)
        out[row, :mb.response_width] = torch.log_softmax(logits, -1)
    return out * batch.response_mask[..., None]


@pytest.mark.parametrize("padding_free", [False, True])
def test_top_k_forward_kl_equals_a_direct_computation_from_the_two_models_logits(tiny_model_path, processor,
                                                                                  synthetic_rows, padding_free):
    """The trainer-side teacher's top-5 per position (`teacher_top_logprobs`) are its 5 largest logprobs, largest
    first, at their ids; the update's distill/loss (one mini-batch, token-mean, coef 1, zero advantages) is
    sum_{i in teacher top-5} p_t(i) (log p_t(i) - log p_s(i)) from the two models' full distributions, meaned over
    the response tokens, and distill/student_topk_mass the student's probability of those ids; padded and packed
    micro-batches alike (a text-only row included). float64: equal up to summation order."""
    from dataclasses import replace

    config = ActorConfig(model_path=tiny_model_path, dtype="float64", compute_dtype="float64",
                         ppo_micro_batch_size_per_gpu=2, padding_free=padding_free, ppo_mini_batch_size=1)
    batch = make_batch(processor, synthetic_rows[:3], n=2, response_length=4, text_only_rows=(1,))
    actor = Actor(config, total_steps=1, mini_batch_samples=len(batch),
                  distill=DistillConfig(teacher="tiny-large", teacher_dtype="float64", mode="loss",
                                        estimator="forward_kl_topk", topk=5))
    teacher_all, student_all = _full_logprobs(actor, actor.teacher, batch), _full_logprobs(actor, actor.model, batch)
    logprobs, values, ids = actor.teacher_top_logprobs(batch, 5)
    mask = batch.response_mask
    real = mask != 0
    top = teacher_all.topk(5, dim=-1)
    torch.testing.assert_close(values, top.values * mask[..., None], rtol=0, atol=1e-10)
    torch.testing.assert_close(teacher_all.gather(-1, ids) * mask[..., None], values, rtol=0, atol=1e-10)
    sampled = teacher_all.gather(-1, batch.response_ids[..., None])[..., 0] * mask
    torch.testing.assert_close(logprobs, sampled, rtol=0, atol=1e-10)
    metrics = actor.update(replace(batch, teacher_topk_ids=ids, teacher_topk_logprobs=values), None,
                           torch.zeros(len(batch), dtype=torch.float64))
    student_at = student_all.gather(-1, ids)
    per_token = (values.exp() * (values - student_at)).sum(-1)
    assert metrics["distill/loss"] == pytest.approx(float(per_token[real].mean()), abs=1e-10)
    assert metrics["distill/student_topk_mass"] == pytest.approx(float(student_at.exp().sum(-1)[real].mean()),
                                                                 abs=1e-10)
