"""A training worker's engine schedule (no Ray needed: the worker object is used in this process, with a real hf
engine and a one-rank ShardedActor). With sleep_between_steps the engine stays awake across a step's generate calls
(an agent step makes one per turn) and sleeps once, when training starts; a weight sync or the next generation wakes
it."""

from __future__ import annotations

from tests.batches import make_batch
from tests.rollout.helpers import GREEDY, build_batch
from vlmrl.config import ActorConfig
from vlmrl.distributed.actor import ShardedActor
from vlmrl.distributed.worker import TrainWorker, WorkerSpec


def test_the_engine_sleeps_once_per_step_not_once_per_generate_call(tiny_model_path, processor, synthetic_rows):
    from vlmrl.rollout import get_backend

    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32")
    worker = TrainWorker(WorkerSpec(actor=config))
    worker.actor = ShardedActor(config, world_size=1)
    with get_backend("hf", tiny_model_path, dtype="float32", max_model_len=1024) as engine:
        calls: list[str] = []
        sleep, wake_up = engine.sleep, engine.wake_up
        engine.sleep = lambda: (calls.append("sleep"), sleep())[1]  # spies: the real methods still run
        engine.wake_up = lambda: (calls.append("wake"), wake_up())[1]
        worker.engine, worker.engine_sleeps = engine, True
        requests = build_batch(engine.processor)[:2]
        for _ in range(3):  # three turns of one agent step
            assert len(worker.generate(requests, GREEDY)) == 2
        assert calls == []
        batch = make_batch(processor, synthetic_rows[:2], n=2)
        worker.compute_logprobs(batch, reference=False, with_entropy=False)
        worker.compute_logprobs(batch, reference=False, with_entropy=False)
        assert calls == ["sleep"]
        assert worker.sync_weights() == len(list(worker.actor.named_tensors()))
        assert calls == ["sleep", "wake"]
        worker.generate(requests, GREEDY)
        assert calls == ["sleep", "wake"]
