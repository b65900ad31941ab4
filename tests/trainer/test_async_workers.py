"""The asynchronous placement with rollout workers of their own (trainer.async_rollout.rollout_workers: engines in
Ray actors, in processes apart from the trainer's), in real runs on the tiny model: two workers give the synchronous
run's metrics and weights exactly at max_staleness=0, also when one of them is killed with SIGKILL mid-run (started
again with the synced weights); with no restart left, a worker's death stops the run with an error naming it."""

from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from tests.ray_helpers import local_ray
from tests.trainer.test_async_fit import ASYNC, CORRECTED, _consumed, _weights, _without_async
from tests.trainer.test_fit import base_args
from vlmrl.config import ConfigError, load_config
from vlmrl.rollout.errors import EngineDeadError
from vlmrl.train import reported_error
from vlmrl.trainer.async_rollout import RolloutWorkerError
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

COMMON = ("trainer.total_steps=4", "trainer.save_freq=4", *CORRECTED)
SAME_SCHEDULE = (ASYNC, "trainer.async_rollout.max_staleness=0")


def _rollout_worker_pids() -> list[int]:
    """The processes of this machine's live RolloutWorker actors (Ray titles an actor's process with its class)."""
    pids = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if "ray::RolloutWorker" in " ".join(process.info["cmdline"] or []):
            pids.append(process.info["pid"])
    return pids


class KillWorkerAfter:
    """fit's stop callback: SIGKILL one rollout worker once step `step` is logged; never stops the run."""

    def __init__(self, step: int):
        self.step, self.killed = step, []

    def __call__(self, step: int, metrics: dict) -> bool:
        if step == self.step and not self.killed:
            self.killed = _rollout_worker_pids()[:1]
            assert self.killed, "no rollout worker process to kill"
            os.kill(self.killed[0], signal.SIGKILL)
        return False


@pytest.fixture(scope="module")
def ray_cluster():
    """Three CPUs: two training workers beside a rollout worker (logical CPUs: the machine has two cores)."""
    with local_ray(num_cpus=3) as temp_dir:
        yield temp_dir


@pytest.mark.ray
def test_rollout_workers_give_the_synchronous_run_and_a_killed_one_is_restarted(tiny_model_path, tmp_path,
                                                                                 ray_cluster):
    """Two workers (each a half of every batch) at max_staleness=0, one of them killed with SIGKILL after step 2:
    started again with the synced weights, its half of the next batch generated again with the same seeds, so the
    run gives the synchronous run's metrics and step-4 weights exactly, every weights probe in sync on both
    engines."""
    fit(load_config(base_args(tiny_model_path, tmp_path / "sync", *COMMON)))
    sync = read_metrics(tmp_path / "sync" / "metrics.jsonl")

    kill = KillWorkerAfter(2)
    fit(load_config(base_args(tiny_model_path, tmp_path / "two", *COMMON, *SAME_SCHEDULE,
                              "trainer.async_rollout.rollout_workers=2")), stop=kill)
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(kill.killed) == 1
    # two engines: the mismatch also per engine (its tokens add up to the run's), and the weights probe asks both
    # (engine 1 against engine 0); the rest is the synchronous run's
    for row in two[1:]:
        assert row["mismatch/engine/0/tokens"] + row["mismatch/engine/1/tokens"] == row["mismatch/tokens"]
    assert all(row["weight_probe/engines_agree"] == 1.0 for row in two)
    assert all(r["weight_probe/in_sync"] == 1.0 for r in two[1:]), "the restarted worker holds the synced weights"
    per_engine = [{k: v for k, v in r.items() if not k.startswith("mismatch/engine/")
                   and k != "weight_probe/engines_agree"} for r in two]
    assert [_without_async(r) for r in per_engine] == [_without_async(r) for r in sync]
    assert _weights(tmp_path / "two", 4) == _weights(tmp_path / "sync", 4)
    restarts = [r["async/worker_restarts"] for r in two[1:]]
    assert restarts[:2] == [0, 0] and restarts[-1] == 1 and restarts == sorted(restarts), restarts
    assert [c["step"] for c in _consumed(tmp_path / "two")] == [1, 2, 3, 4]
    assert not _rollout_worker_pids(), "the run's end closed its workers"


@pytest.mark.ray
def test_a_dead_rollout_worker_with_no_restart_left_stops_the_run_naming_it(tiny_model_path, tmp_path, ray_cluster):
    """Killed after step 2 with worker_restarts=0: whichever call meets the dead worker first (the rollout thread's
    next batch: RolloutWorkerError; the trainer's weight sync or probe: EngineDeadError) stops the run naming it."""
    out = tmp_path / "run"
    with pytest.raises((RolloutWorkerError, EngineDeadError), match=r"rollout worker 0 \(pid \d+\) died.*worker_restarts used up") as raised:
        fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=5", "trainer.test_freq=-1", *CORRECTED,
                                  ASYNC, "trainer.async_rollout.rollout_workers=1",
                                  "trainer.async_rollout.worker_restarts=0")), stop=KillWorkerAfter(2))
    # python -m vlmrl.train ends it as one error line naming the worker and its pid (exit 1), not chained tracebacks
    message, code = reported_error(raised.value)
    assert code == 1 and "\n" not in message, message
    assert re.fullmatch(r".*rollout worker 0 \(pid \d+\) died: \w+ \(trainer.async_rollout.worker_restarts used up: "
                        r"the run stops\)", message), message
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps[-1] in (2, 3), steps  # step 3's batch may have been made before the kill
    assert not _rollout_worker_pids()


# A variant (marker `full`, make test-all; 42 s): make test keeps the rollout worker beside one training process (the
# test above, with its restart), and dp = 2 training through the synchronous loop (tests/trainer/test_fit.py::
# test_two_device_run_goes_through_the_same_loop) and its sync into colocated engines (tests/distributed).
@pytest.mark.ray
@pytest.mark.full
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_training_workers_train_beside_a_rollout_worker(tiny_model_path, tmp_path, ray_cluster, engine):
    """trainer.n_gpus_per_node=2 (FSDP2 ranks that only train) and one rollout worker: the weights gathered from
    the shards reach the worker's engine after every step (every probe in sync), no batch beyond the bound; through
    the object store on hf, sent by training rank 0 over the weight group on vLLM."""
    out = tmp_path / "dp2"
    fit(load_config(base_args(tiny_model_path, out, "trainer.n_gpus_per_node=2", "trainer.total_steps=3",
                              f"rollout.name={engine}", "rollout.dtype=float32",
                              "trainer.test_freq=-1", "trainer.val_before_train=false", *CORRECTED, ASYNC,
                              "trainer.async_rollout.max_staleness=1", "trainer.async_rollout.rollout_workers=1")))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_probe/in_sync"] == 1.0 and 0 <= r["async/staleness"] <= 1 for r in rows), rows
    assert [c["step"] for c in _consumed(out)] == [1, 2, 3]
    assert not _rollout_worker_pids()


def test_rollout_workers_outside_the_async_placement_are_refused():
    with pytest.raises(ConfigError, match="places the engines of the asynchronous placement"):
        load_config(["actor.model_path=tiny", "data.train_files=synthetic", "trainer.async_rollout.rollout_workers=1"])
