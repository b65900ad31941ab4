"""The distillation teacher on an engine of its own (algorithm.distill.teacher_engine): refused before anything
starts where it cannot score the student's samples; its logprobs of the student's own samples (images included)
equal the teacher loaded in the trainer (the first-step check, on every sample); a one-step fit with it logs the
distill/* metrics and the trainer-teacher fit's reverse KL; the check's rule stops a run whose engine scores
otherwise. fp32 on CPU; the student samples on hf (seeded, so every fit samples the same batch), the teacher is
tiny-large (another size of the student's family)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.batches import sampled_student_batch
from tests.trainer.test_distill_fit import ONE_STEP
from tests.trainer.test_fit import base_args
from vlmrl.config import ConfigError, load_config
from vlmrl.train import main
from vlmrl.trainer.fit import fit

FP32_BAND = 1e-3
"""The run's band for two float32 sides (`vlmrl.alignment.weight_probe.tolerance_for`, what the first-step check
holds the engine to). Measured on tiny-large's 64 sampled tokens: vLLM 5e-5, SGLang 2.8e-5, hf 1e-6 (the engines'
contract's 1e-4 was measured on the smaller tiny; this deeper, wider teacher sits closer to it)."""
SUMMATION_SLACK = 1e-6
"""Float rounding of a mean of ~10-nat float32 logprobs (relative 1e-7)."""
TEACHER = ("algorithm.distill.teacher=tiny-large", "algorithm.distill.mode=loss", "actor.ppo_mini_batch_size=4",
           "algorithm.distill.estimator=forward_kl_topk", "algorithm.distill.topk=4",
           "algorithm.distill.engine_check_samples=16")
"""Top-k forward KL (the teacher's top 4 per position), one optimizer step (the batch is one mini-batch) and the
check on all 16 samples of the step."""


@pytest.mark.parametrize("extra, says", [
    (("rollout.temperature=0.7",), "set rollout.temperature=1.0"),
    (("agent.enable=true",), "agent.enable trajectories hold tool turns"),
    (("trainer.n_gpus_per_node=2",), "runs in the driver's process"),
])
def test_an_engine_teacher_that_cannot_score_the_samples_is_refused_with_one_error_line(tmp_path, capsys, extra,
                                                                                         says):
    """Before anything starts (exit 2): an engine scores the raw distribution (not a tempered one), a prompt plus
    the sampled tokens (not a multi-turn trajectory), in the driver's process (not a training worker's)."""
    args = base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large",
                     "algorithm.distill.teacher_engine=hf", *extra)
    with pytest.raises(ConfigError, match=says):
        load_config(args)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "algorithm.distill.teacher_engine=hf" in err and says in err, err


def test_an_unknown_teacher_engine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher_engine='tgi' is not one of \['trainer', 'hf'"):
        load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large",
                              "algorithm.distill.teacher_engine=tgi"))


@pytest.mark.parametrize("extra, says", [
    (("algorithm.distill.teacher_engine=vllm", "algorithm.distill.teacher_url=http://127.0.0.1:30000"),
     "teacher_url='http://127.0.0.1:30000' is read by teacher_engine=sglang-server, not vllm"),
    (("algorithm.distill.teacher_engine=sglang-server", "algorithm.distill.teacher_url=127.0.0.1:30000"),
     "must start with http:// or https://"),
])
def test_a_teacher_url_that_cannot_be_used_is_refused(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large", *extra))


@pytest.fixture(scope="module")
def trainer_teacher_fit(tmp_path_factory):
    """The reference: the same one-step fit with the teacher in the trainer."""
    out = tmp_path_factory.mktemp("trainer_teacher")
    return fit(load_config(base_args("tiny", out, *ONE_STEP, *TEACHER)))


def assert_equals_the_trainer_teacher_fit(metrics: dict, reference: dict, engine: str) -> None:
    """The engine teacher's first-step check held on every sample (the sampled tokens' logprobs and the engine's
    top-4 ids' logprobs against the teacher in the trainer), and the fit's sampled-token metrics are the
    trainer-teacher fit's: the same samples (the student samples on hf, seeded) and student logprobs, the teacher's
    within the check's gap per token, so their means (reverse KL, the teacher's logprob) within that gap too:
    |mean(a) - mean(b)| <= max |a - b|. The top-k loss and masses are logged."""
    gap = metrics["distill/first_step_engine_gap"]
    assert 0 <= gap <= FP32_BAND, f"{engine} teacher vs the teacher in the trainer: max |d| {gap:.2e}"
    assert "distill/first_step_engine_gap" not in reference
    assert metrics["distill/student_logprob"] == reference["distill/student_logprob"]
    for key in ("distill/reverse_kl", "distill/teacher_logprob"):
        assert abs(metrics[key] - reference[key]) <= gap + SUMMATION_SLACK, (engine, key, metrics[key], reference[key])
    assert metrics["distill/teacher_logprob"] != metrics["distill/student_logprob"]
    for key in ("distill/teacher_topk_mass", "distill/student_topk_mass"):
        assert 0 < metrics[key] <= 1 + SUMMATION_SLACK, (engine, key, metrics[key])
    assert metrics["distill/loss"] > 0, metrics["distill/loss"]  # the untrained tiny student is far from tiny-large


def test_a_fit_with_the_teacher_on_the_hf_backend_equals_the_trainer_teacher_fit(tmp_path, trainer_teacher_fit):
    """The engine path (requests found by uid, scores laid into the batch's response columns, the first-step
    check) on transformers' reference backend: no engine, the same numbers."""
    metrics = fit(load_config(base_args("tiny", tmp_path / "run", *ONE_STEP, *TEACHER,
                                        "algorithm.distill.teacher_engine=hf")))
    assert_equals_the_trainer_teacher_fit(metrics, trainer_teacher_fit, "hf")
    assert "timing/teacher_logprobs" in metrics


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.vllm),
                                    pytest.param("sglang", marks=pytest.mark.sglang)])
def test_a_fit_with_the_teacher_on_an_engine_equals_the_trainer_teacher_fit(tmp_path, trainer_teacher_fit, engine):
    """vLLM's prompt logprobs / SGLang's input logprobs of the student's 16 samples (each prompt with its image),
    on the same requests the student sampled from, equal the teacher in the trainer on every token (fp32), and the
    fit's reverse KL is the trainer-teacher fit's."""
    metrics = fit(load_config(base_args("tiny", tmp_path / "run", *ONE_STEP, *TEACHER,
                                        f"algorithm.distill.teacher_engine={engine}")))
    assert_equals_the_trainer_teacher_fit(metrics, trainer_teacher_fit, engine)


@pytest.fixture(scope="module")
def student_samples(processor, synthetic_rows):
    """Three prompts with their images, sampled twice each by the student on hf, padded and stacked as a step does,
    with padding rows up to 8: (requests, batch)."""
    return sampled_student_batch(processor, synthetic_rows)


def assert_same_top_k(engine_ids: torch.Tensor, engine_values: torch.Tensor, trainer_ids: torch.Tensor,
                      trainer_values: torch.Tensor, mask: torch.Tensor, tol: float) -> None:
    """Two top-k lists per position agree: their k values rank by rank within `tol` (order statistics move no more
    than the values do, so near-ties change nothing), and every id the trainer ranks clear of its k-th value by more
    than 2 tol (no near-tie at the cut) is among the engine's ids."""
    real = mask != 0
    worst = float((engine_values - trainer_values).abs()[real].max())
    assert worst <= tol, f"top-k values, engine vs trainer: max |d| {worst:.2e}"
    clear = trainer_values > trainer_values[..., -1:] + 2 * tol  # (B, R, k)
    found = (trainer_ids.unsqueeze(-1) == engine_ids.unsqueeze(-2)).any(-1)  # trainer id among the engine's
    missing = clear & ~found & real.unsqueeze(-1)
    assert not missing.any(), f"{int(missing.sum())} of the trainer's top-k ids (clear of the cut) not in the engine's"


def test_engine_scores_are_the_trainer_teachers_in_the_batch_layout(tmp_path, student_samples):
    """The teacher's backend scores each real row after its own request (found by uid): its sampled-token logprobs
    and its top-4 per position equal the teacher in the trainer (`teacher_top_logprobs`) on every response token
    (values rank by rank, ids up to near-ties), largest first; 0 on the response padding and on the padding rows;
    the first-step check passes and reports that gap."""
    from vlmrl.actor.local import Actor
    from vlmrl.algorithms.config import DistillConfig
    from vlmrl.rollout.registry import get_backend
    from vlmrl.trainer.teacher_engine import engine_scores, first_step_check

    requests, batch = student_samples
    config = load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large",
                                   "algorithm.distill.teacher_engine=hf", "algorithm.distill.engine_check_samples=8"))
    with get_backend("hf", "tiny-large", dtype="float32", max_model_len=128) as teacher:
        scores = engine_scores(teacher, batch, list(reversed(requests)), top_k=4)  # found by uid, not by position
        gap = first_step_check(config, batch, scores, teacher)
    actor = Actor(config.actor, total_steps=1, mini_batch_samples=8,
                  distill=DistillConfig(teacher="tiny-large", teacher_dtype="float32"))
    expected, values, ids = actor.teacher_top_logprobs(batch, 4)
    real = batch.response_mask != 0
    for tensor in (scores.logprobs, scores.topk_logprobs, scores.topk_ids):
        assert not tensor[~real].any(), "padding must hold 0"
    assert (scores.logprobs[real] < 0).all() and (scores.topk_logprobs[real].diff(dim=-1) <= 0).all()
    worst = float((scores.logprobs - expected).abs().max())
    assert worst <= FP32_BAND and gap <= FP32_BAND, (worst, gap)
    assert_same_top_k(scores.topk_ids, scores.topk_logprobs, ids, values, batch.response_mask, FP32_BAND)


def test_the_check_stops_a_run_whose_engine_scores_another_model_naming_the_token(tmp_path, student_samples):
    """An engine holding other weights than the teacher (the student's, here) scores the same tokens nats away:
    the check raises the start-up check's error kind (one `error:` line, exit 1) naming the metric, the first
    token and both values."""
    from vlmrl.rollout.registry import get_backend
    from vlmrl.train import reported_error
    from vlmrl.trainer.teacher_engine import TeacherEngineError, engine_scores, first_step_check

    requests, batch = student_samples
    config = load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny-large",
                                   "algorithm.distill.teacher_engine=hf"))
    with get_backend("hf", "tiny", dtype="float32", max_model_len=128) as other:
        with pytest.raises(TeacherEngineError, match=r"distill/first_step_engine_gap=[0-9.e+-]+ nats > 0\.001 "
                                                     r"\(the band of float32 vs float32\); first at sample \d") as err:
            first_step_check(config, batch, engine_scores(other, batch, requests, top_k=2), other)
    assert reported_error(err.value) == (str(err.value), 1)
    assert "engine_check_samples=0" in str(err.value)


def test_largest_gap_counts_the_masked_tokens_only():
    from vlmrl.trainer.teacher_engine import largest_gap

    engine = torch.tensor([[[-1.0, -1.0], [-2.0, -3.0], [0.0, 0.0]], [[-3.0, -3.0], [-4.5, -5.0], [-1.0, -1.0]]])
    trainer = torch.tensor([[[-1.0, -1.0], [-2.0005, -3.0], [0.0, 0.0]], [[-3.0, -3.0], [-4.5, -4.0], [-9.0, 0.0]]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding: its gap does not count
    assert largest_gap(engine, trainer, mask) == (pytest.approx(1.0), 1, 1, 1)
    assert largest_gap(engine[:1], trainer[:1], mask[:1])[0] == pytest.approx(5e-4, rel=1e-4)  # float32's -2.0005
