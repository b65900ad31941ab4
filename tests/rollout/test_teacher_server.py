"""The distillation teacher served by URL (algorithm.distill.teacher_engine=sglang-server with teacher_url), as
verl's and slime's teacher servers run on devices of their own: accepted at dp > 1, it scores the student's samples
(images included) as the teacher loaded in the trainer, and the run leaves the user's server running. The server is
the session's shared SGLang server on the tiny model, fp32."""

from __future__ import annotations

import pytest

from tests.batches import sampled_student_batch
from tests.rollout.helpers import GREEDY
from tests.trainer.test_fit import base_args
from tests.trainer.test_teacher_engine import FP32_BAND, assert_same_top_k
from vlmrl.config import load_config

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def student_samples(processor, synthetic_rows):
    return sampled_student_batch(processor, synthetic_rows)


def test_a_teacher_served_by_url_runs_at_dp2_scores_as_the_trainer_and_is_left_running(
        sglang_server_qwen2_5_vl, student_samples, tmp_path):
    """trainer.n_gpus_per_node=2 with the teacher at a URL loads (an engine teacher in this process is refused
    there); the client scores each real row after its own request: the sampled tokens' logprobs and the top-4 per
    position equal the teacher in the trainer (fp32 band), the first-step check passes; closing the teacher leaves
    the server serving."""
    from vlmrl.actor.local import Actor
    from vlmrl.algorithms.config import DistillConfig
    from vlmrl.trainer.components import start_teacher_engine
    from vlmrl.trainer.teacher_engine import GAP_METRIC

    server = sglang_server_qwen2_5_vl
    requests, batch = student_samples
    config = load_config(base_args("tiny", tmp_path / "run", "algorithm.distill.teacher=tiny",
                                   "algorithm.distill.teacher_engine=sglang-server",
                                   f"algorithm.distill.teacher_url={server.url}", "algorithm.distill.mode=loss",
                                   "algorithm.distill.estimator=forward_kl_topk", "algorithm.distill.topk=4",
                                   "algorithm.distill.engine_check_samples=8", "trainer.n_gpus_per_node=2"))
    teacher = start_teacher_engine(config)
    try:
        assert teacher.backend.url == server.url and teacher.backend.server is None, "a client, nothing launched"
        scores, metrics = teacher.scores(config, batch, requests, 4)
    finally:
        teacher.close()
    assert 0 <= metrics[GAP_METRIC] <= FP32_BAND, metrics
    actor = Actor(config.actor, total_steps=1, mini_batch_samples=8,
                  distill=DistillConfig(teacher="tiny", teacher_dtype="float32"))
    expected, values, ids = actor.teacher_top_logprobs(batch, 4)
    worst = float((scores.logprobs - expected).abs().max())
    assert worst <= FP32_BAND, f"the served teacher vs the teacher in the trainer: max |d| {worst:.2e}"
    assert_same_top_k(scores.topk_ids, scores.topk_logprobs, ids, values, batch.response_mask, FP32_BAND)
    assert server.generate(requests[:1], GREEDY)[0].response_ids, "the user's server still serves after the run"
