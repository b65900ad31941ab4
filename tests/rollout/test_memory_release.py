"""Memory release between rollout and training: the run's rollout.vllm.enable_sleep_mode / sleep_level and
rollout.sglang.enable_memory_saver reach the engines' constructors, and the sleep and wake calls of the trainer (one
process) and of a training worker reach the engine.

vLLM refuses sleep mode on a CPU at config time (`is_sleep_mode_available`), while its CPU worker runs the whole
sleep path (scheduler paused, caches reset, executor asleep) and only keeps its memory. The CPU tests lift that one
platform check, so the real engine runs the real calls; the `gpu` test measures the memory a sleep frees."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.helpers import GREEDY

pytestmark = pytest.mark.vllm


@pytest.fixture
def sleep_mode_on_cpu(monkeypatch):
    """Lets vLLM start with sleep mode on this CPU (see the module docstring)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)


@pytest.fixture(scope="module")
def sleeping(tiny_model_path):
    """A vLLM engine started with sleep mode (fp32), shared by the module; each test leaves it awake."""
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
        engine = _sleeping_engine(tiny_model_path)
    with engine:
        yield engine


@pytest.fixture(scope="module")
def checkpoint(tiny_model_path):
    """The model's own weights, by checkpoint name: a full weight sync."""
    from pathlib import Path

    from safetensors.torch import load_file

    return {k: v for file in sorted(Path(tiny_model_path).glob("*.safetensors")) for k, v in load_file(file).items()}


def _sleeping_engine(tiny_model_path, **options):
    from vlmrl.rollout.registry import get_backend

    return get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                       enable_sleep_mode=True, **options)


def test_sleep_mode_reaches_vllm_and_sleep_and_wake_reach_the_engine(sleeping, batch, hf_greedy, checkpoint):
    engine = sleeping
    core = engine.llm.llm_engine
    assert core.vllm_config.model_config.enable_sleep_mode, "the option reached vLLM's constructor"
    assert engine.releases_memory() and not core.is_sleeping()
    engine.sleep()
    assert core.is_sleeping() and engine.asleep == ("weights", "kv_cache")
    engine.sleep()  # idempotent: already asleep
    engine.update_weights(checkpoint.items())  # takes its weights back first, not yet the KV cache
    assert engine.asleep == ("kv_cache",) and core.is_sleeping()
    got = engine.generate(batch, GREEDY)  # wakes the rest
    assert not core.is_sleeping() and engine.asleep == ()
    assert [r.response_ids for r in got] == [r.response_ids for r in hf_greedy]


def test_sleep_level_two_needs_a_weight_sync_before_generating(sleeping, batch, hf_greedy, checkpoint, monkeypatch):
    from vlmrl.rollout.errors import RolloutError

    engine = sleeping
    monkeypatch.setattr(engine.rollout.vllm, "sleep_level", 2)  # read when the engine is put to sleep
    engine.sleep()
    assert engine.weights_dropped and not engine.takes_partial_weights()
    with pytest.raises(RolloutError, match="discarded its weights while asleep"):
        engine.generate(batch[:1], GREEDY)
    assert engine.llm.llm_engine.is_sleeping(), "refused before the engine was woken"
    engine.update_weights(checkpoint.items())
    assert not engine.weights_dropped
    assert [r.response_ids for r in engine.generate(batch, GREEDY)] == [r.response_ids for r in hf_greedy]


def test_sleep_mode_is_off_on_cpu_by_default_and_refused_by_vllm_when_asked(tiny_model_path, vllm_qwen2_5_vl):
    vllm_engine = vllm_qwen2_5_vl  # the shared engine, started with the defaults
    assert not vllm_engine.releases_memory()
    vllm_engine.sleep()  # a no-op, said once in the log
    assert vllm_engine.asleep == () and not vllm_engine.llm.llm_engine.is_sleeping()
    with pytest.raises(Exception, match="rollout.vllm.enable_sleep_mode=true: vLLM says 'Sleep mode is not supported"):
        _sleeping_engine(tiny_model_path)


@pytest.mark.sglang
def test_the_memory_saver_reaches_sglang(tiny_model_path):
    """SGLang takes enable_memory_saver on a CPU only to fail for want of torch-memory-saver (a CUDA library):
    the option reached its constructor."""
    from vlmrl.rollout.errors import RolloutError
    from vlmrl.rollout.registry import get_backend

    with pytest.raises(RolloutError, match="sglang: start the engine failed: .*torch_memory_saver"):
        get_backend("sglang", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                    enable_memory_saver=True)


def test_a_worker_sleeps_its_engine_once_per_step_and_wakes_it_for_the_sync(tiny_model_path, sleeping, processor,
                                                                            synthetic_rows, batch):
    """An agent step generates once per turn: the engine stays awake across them, sleeps when training starts,
    takes its weights back for the sync and its KV cache for the next generate."""
    from tests.batches import make_batch
    from vlmrl.config import ActorConfig
    from vlmrl.distributed.actor import ShardedActor
    from vlmrl.distributed.worker import TrainWorker, WorkerSpec

    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32")
    worker = TrainWorker(WorkerSpec(actor=config))
    worker.actor = ShardedActor(config, world_size=1)
    engine = sleeping
    worker.engine = engine
    core = engine.llm.llm_engine
    for _ in range(3):  # three turns of one agent step
        assert len(worker.generate(batch[:2], GREEDY)) == 2
        assert not core.is_sleeping()
    train = make_batch(processor, synthetic_rows[:2], n=2)
    worker.compute_logprobs(train, reference=False, with_entropy=False)
    assert core.is_sleeping()
    worker.compute_logprobs(train, reference=False, with_entropy=False)
    assert worker.sync_weights() == len(list(worker.actor.named_tensors()))
    assert engine.asleep == ("kv_cache",)
    worker.generate(batch[:2], GREEDY)
    assert not core.is_sleeping() and engine.asleep == ()


@pytest.mark.slow
def test_the_trainer_sleeps_the_engine_and_trains_as_without(tmp_path, sleep_mode_on_cpu):
    """One process: with sleep mode the engine sleeps each step while the actor trains (timing/engine_sleep), and
    the run's metrics are the same as without it."""
    import json

    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit

    def run(name: str, *extra: str) -> list[dict]:
        out = tmp_path / name
        fit(load_config(["config=examples/configs/tiny_synthetic.yaml", "rollout.name=vllm", "trainer.total_steps=2",
                         "trainer.format_warmup_steps=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
                         "trainer.save_freq=-1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                         "actor.ppo_micro_batch_size_per_gpu=8", "data.synthetic_train_size=16", "data.synthetic_val_size=4", f"trainer.output_dir={out}",
                         *extra]))
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    asleep, awake = run("sleep", "rollout.vllm.enable_sleep_mode=true"), run("awake")
    assert all("timing/engine_sleep" in step for step in asleep)
    assert not any("timing/engine_sleep" in step for step in awake)
    for slept, kept in zip(asleep, awake, strict=True):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert slept[key] == kept[key], key


@pytest.mark.gpu
def test_a_colocated_engine_frees_its_gpu_memory_while_asleep():
    """On a GPU the default (colocated) frees the weights and the KV cache: the device's free memory grows by at
    least the KV cache vLLM reserved, and comes back after the wake."""
    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.registry import get_backend

    path = str(ensure_built("tiny-large"))
    with get_backend("vllm", path, max_model_len=1024, gpu_memory_utilization=0.3, colocated=True) as engine:
        assert engine.releases_memory()
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        torch.cuda.synchronize()
        freed = torch.cuda.mem_get_info()[0] - before
        total = torch.cuda.mem_get_info()[1]
        assert freed > 0.2 * total, f"sleep freed {freed / 2**30:.2f} GiB of {total / 2**30:.1f}"
        engine.wake_up()
        assert torch.cuda.mem_get_info()[0] < before + 0.05 * total
