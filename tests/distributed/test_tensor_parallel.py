"""Rollout engines at tensor parallel 2 colocated with two training workers (dp = 2, CPU, gloo, float32): verl's
layout (`vlmrl.distributed.layout.EngineLayout`). vLLM runs one TP rank in each worker's process (its external
launcher, through the trainer's own process group); SGLang's engine is built by the first worker and starts its two
TP processes itself, each bound to its own core (vlmrl sets SGLANG_CPU_OMP_THREADS_BIND).

The engine at TP 2 gives transformers' greedy tokens with images (the engine contract shows TP 1 does; vLLM's
seeded samples at TP 2 equal TP 1's in the two-device fit step, tests/trainer/test_fit.py); a weight sync from the
trainer's shards lands on both TP ranks (a sync that reached one rank only would leave the other half of every
layer on the old weights, far beyond the float32 band) and the weight probe calls it in sync; a TP rank killed
mid-generate ends the call with one named error, not a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, build_batch, greedy_problems
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.ray
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)


@pytest.fixture(scope="module")
def hf_reference(tiny_model_path):
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as hf:
        batch = build_batch(hf.processor)
        yield hf, batch, hf.generate(batch, GREEDY)


@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.vllm),
                                        pytest.param("sglang", marks=pytest.mark.sglang)])
def tp2(request, ray_cluster, tiny_model_path):
    """(the DistributedActor, its ColocatedEngines) at dp = 2, rollout.tensor_parallel_size = 2."""
    from vlmrl.actor.config import ActorConfig, OptimConfig
    from vlmrl.distributed.engines import ColocatedEngines
    from vlmrl.distributed.group import ClusterSpec, DistributedActor
    from vlmrl.distributed.worker import EngineSpec, WorkerSpec
    from vlmrl.rollout.base import BackendOptions

    options = BackendOptions.from_kwargs(request.param, {"dtype": "float32", "max_model_len": 1024, "timeout_s": 120,
                                                         "tensor_parallel_size": 2})
    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32", ppo_micro_batch_size_per_gpu=4,
                         optim=OptimConfig(lr=1e-2, weight_decay=0.0), share_vision=False)
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2),
                             WorkerSpec(actor=config, engine=EngineSpec(request.param, tiny_model_path, options),
                                        torch_threads=1, timeout_s=120),
                             mini_batch_samples=8, timeout_s=120, startup_timeout_s=600)
    engines = ColocatedEngines(actor)
    try:
        yield actor, engines
    finally:
        engines.close()


def test_the_layout_is_one_engine_across_both_ranks(tp2):
    actor, engines = tp2
    assert actor.layout.groups == [[0, 1]] and actor.layout.leaders == [0]
    assert actor.hosts == ([0, 1] if engines.name == "vllm" else [0])
    assert "1 %s engine at tensor parallel 2" % engines.name in actor.layout.describe()
    assert engines.dtype == "float32", "the dtype the workers' engines report"


def test_greedy_at_tp2_equals_transformers_with_images(tp2, hf_reference):
    """Nine requests with 0-2 images: transformers' ids token for token, its logprobs to float rounding (the engine
    contract holds TP 1 to the same, so TP 2 == TP 1; vLLM's seeded samples at TP 2 == TP 1: tests/trainer/test_fit.py,
    the two-device step)."""
    _, engines = tp2
    _, batch, expected = hf_reference
    problems = greedy_problems(expected, engines.generate(batch, GREEDY), f"{engines.name} tp2", LOGPROB_TOL)
    assert not problems, "\n".join(problems)


def _batch_of(processor, requests, results, n):
    from vlmrl.batch.padding import pad_sample, stack_samples

    return stack_samples([pad_sample(processor.prompt_inputs(requests[i // n]), result.response_ids,
                                     prompt_length=160, response_length=6, pad_token_id=processor.pad_token_id,
                                     rollout_logprobs=result.response_logprobs)
                          for i, result in enumerate(results)])


def _gap(actor, batch) -> float:
    logprobs, _ = actor.compute_logprobs(batch)
    return float(((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).max())


def test_a_weight_sync_from_the_shards_lands_on_both_tp_ranks(tp2, hf_reference):
    """An update moves the policy by more than 1e-2 nats on its own samples; after the sync (each worker gathers the
    full weights and loads them into its TP rank, each rank slicing its shard) the engine's logprobs are the
    trainer's to float32 rounding, and the weight probe says in_sync."""
    from vlmrl.trainer.engine_probe import WeightProbe

    actor, engines = tp2
    hf, batch, _ = hf_reference
    requests = [batch[0], batch[3], batch[6], batch[7]]  # text, one image, two images
    processor = engines.processor
    probe = WeightProbe(batch[3], processor, tokens=6, prompt_length=160, temperature=1.0, action="error")
    probe(actor, engines, 0, 0)
    first = _batch_of(processor, requests, engines.generate(requests, SAMPLED), 2)
    assert _gap(actor, first) < 1e-4, "the engine and the trainer start from the same weights"
    actor.update(first, None, torch.tensor([1.0, -1.0] * 4))
    assert _gap(actor, first) > 1e-2, "the update should move the policy (else nothing is tested)"
    assert actor.sync_weights(engines) > 0
    second = _batch_of(processor, requests, engines.generate(requests, SAMPLED), 2)
    assert _gap(actor, second) < 1e-4, "the sync did not land on every TP rank"
    probe(actor, engines, 1, 1)
    assert probe.last.verdict == "in_sync" and probe.last.max_abs_dlogp < 1e-3, probe.last.explanation


def _engine_pids(actor, rank: int) -> list[int]:
    import ray

    return ray.get(actor.workers[rank].engine_pids.remote(), timeout=60)


def test_a_tp_rank_killed_mid_generate_is_one_named_error(tp2, hf_reference):
    """Last in the module (it ends the engine). vLLM: the second worker's process, which holds TP rank 1; SGLang:
    its TP 1 scheduler process. The call fails within the rollout timeout with an error that names what died."""
    actor, engines = tp2
    _, batch, _ = hf_reference
    if engines.name == "vllm":
        victim = actor.pids[1]
    else:
        import psutil

        victim = next(pid for pid in _engine_pids(actor, 0) if "TP1" in " ".join(psutil.Process(pid).cmdline()))
    long = SamplingParams(n=4, temperature=1.0, max_new_tokens=400, seed=1)
    threading.Timer(2.0, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)) as failed:
        engines.generate(batch * 4, long)
    assert time.monotonic() - start < 120 + 30, "not within the rollout timeout"
    assert "died" in str(failed.value) or "exited" in str(failed.value) or "dead" in str(failed.value), failed.value
