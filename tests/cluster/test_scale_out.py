"""Rollout workers off the driver's node, on a simulated multi-node Ray cluster (tests/cluster/conftest.py): engines
at tensor parallel 2 placed by their placement groups on another node, weights sent to them through a collective
group (gloo) or Ray's object store, a worker killed mid-sync (SGLang's), the asynchronous run on the cluster against
the single-node run, and the refusals a user meets before training: a cluster too small, a weight group that cannot
form."""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import replace

import pytest

from tests.cluster.conftest import remote_engines, scaled_mlps
from tests.rollout.helpers import GREEDY, LOGPROB_TOL, build_batch, clone_state, greedy_problems
from vlmrl.rollout.errors import RolloutError

pytestmark = pytest.mark.ray

ENGINE_MARKS = {"vllm": pytest.mark.vllm, "sglang": pytest.mark.sglang}


@pytest.fixture(scope="module")
def hf():
    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", str(ensure_built("tiny")), dtype="float32", max_model_len=1024) as backend:
        yield backend


@pytest.fixture(scope="module")
def batch(hf):
    return build_batch(hf.processor)


# vLLM's worker at TP 2 (its engine's two TP processes on the worker's 2-CPU bundle); SGLang's at TP 1 in make test:
# its TP 2 engine is tested colocated (tests/distributed/test_tensor_parallel.py), and its start at TP 2 here cost
# 50 s more of make test's 20 minutes.
WORKERS = {"vllm": 2, "sglang": 1}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=mark) for name, mark in ENGINE_MARKS.items()])
def worker(request, cluster):
    """One rollout worker on another node (vLLM at tensor parallel 2, SGLang at 1), weights over the group."""
    engines = remote_engines(request.param, WORKERS[request.param], weight_transfer="collective")
    yield engines
    engines.close()


def test_a_worker_on_another_node_gives_transformers_outputs_and_takes_weights_over_the_group(worker, hf, batch):
    """Placed off the driver's node, the engine's greedy results (vLLM at TP 2) on nine requests with 0-2 images
    equal transformers' token for token, to float rounding (as TP 1's do: tests/rollout). A sync over the gloo group
    lands another model (== transformers running it), holding bitwise the weights the object store's sync of the
    same tensors gives (the engine's own checksum over both TP ranks); the originals bring the first weights back,
    bit for bit."""
    import ray

    assert worker.transfer == "collective" and worker.tp == WORKERS[worker.name]
    assert worker.infos[0]["node"] != ray.get_runtime_context().get_node_id(), "the worker is on the driver's node"
    first, started = worker.generate(batch, GREEDY), worker.weights_checksums()
    problems = greedy_problems(hf.generate(batch, GREEDY), first, worker.name, LOGPROB_TOL)
    assert not problems, "\n".join(problems)

    original = clone_state(hf.model)
    moved = scaled_mlps(original)
    try:
        worker.update_weights(moved)
        assert worker.sent_bytes > 0 and [info["version"] for info in worker.infos] == [worker.version]
        over_group = worker.weights_checksums()
        after = worker.generate(batch, GREEDY)
        hf.update_weights(moved)
        problems = greedy_problems(hf.generate(batch, GREEDY), after, worker.name, LOGPROB_TOL)
        assert not problems, "engine after the group's sync != transformers with the same weights:\n" + \
            "\n".join(problems)
        assert sum(a.response_ids != b.response_ids for a, b in zip(first, after)) >= len(batch) // 2

        worker.transfer = "object_store"
        worker.update_weights(list(original.items()))
        assert worker.weights_checksums() == started
        worker.update_weights(moved)
        assert worker.weights_checksums() == over_group != started, "the two transfers load different weights"
    finally:
        hf.update_weights(original.items())
        worker.transfer = "collective"
        worker.update_weights(list(original.items()))
    assert worker.weights_checksums() == started
    assert [r.response_ids for r in worker.generate(batch, GREEDY)] == [r.response_ids for r in first]


@pytest.mark.vllm
# On vLLM's worker at TP 2 in make test (rank 0 into two engine ranks); SGLang's in `full`: the ranks' side is the same
# for every engine, and each engine's own side of a collective sync is tested on both above.
@pytest.mark.parametrize("worker", [pytest.param("vllm", marks=pytest.mark.vllm),
                                    pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.full])],
                         indirect=True)
def test_training_ranks_send_each_sync_over_the_group_themselves(worker, hf, batch, monkeypatch):
    """dp = 2 training workers (FSDP2 shards) beside the rollout worker, which takes its syncs from them: training
    rank 0 joins the weight group as its sender and broadcasts each bucket as both ranks gather it, so the full
    weights never reach the driver (gathering them there fails this test). The engine then holds bitwise what the
    driver's sync of the same weights loads (its own checksum over its TP ranks) and gives transformers' outputs on
    them; the driver sends again once the group is formed back with it."""
    from vlmrl.distributed.group import DistributedActor

    started, original = worker.weights_checksums(), clone_state(hf.model)
    actor = training_ranks(worker.model_path)
    try:
        worker.update_weights(scaled_mlps(original))  # from the driver: the engine on other weights first
        assert worker.weights_checksums() != started
        worker.send_from(actor)
        with monkeypatch.context() as patched:
            patched.setattr(DistributedActor, "named_tensors", _no_gather)
            loaded = actor.sync_weights(worker)  # the training ranks' own weights: the tiny model's
        assert loaded == len(worker.sync_state(original.items()))
        assert worker.weights_checksums() == started, "the ranks' sync loads other bytes than the driver's"
        assert all(info["version"] == worker.version for info in worker.infos)
        problems = greedy_problems(hf.generate(batch[:4], GREEDY), worker.generate(batch[:4], GREEDY), worker.name,
                                   LOGPROB_TOL)
        assert not problems, "\n".join(problems)
    finally:
        worker.send_from(None)
        actor.close()
    worker.update_weights(scaled_mlps(original))
    assert worker.weights_checksums() != started, "the driver sends over the group formed back with it"
    worker.update_weights(list(original.items()))


def training_ranks(model_path: str):
    """dp = 2 training workers (FSDP2 shards, float32) that only train: the weight group's sender at dp > 1."""
    from vlmrl.actor.config import ActorConfig
    from vlmrl.distributed.group import ClusterSpec, DistributedActor
    from vlmrl.distributed.worker import WorkerSpec

    return DistributedActor(ClusterSpec(n_gpus_per_node=2),
                            WorkerSpec(actor=ActorConfig(model_path=model_path, device="cpu", dtype="float32"),
                                       torch_threads=1, timeout_s=120), mini_batch_samples=2, timeout_s=300)


def _no_gather(self):
    raise AssertionError("the full weights were gathered to the driver")


def test_a_cluster_that_cannot_hold_the_workers_is_one_named_error_before_any_engine(cluster):
    """TP 4 on nodes of 2 CPUs: no node holds the worker's bundle; the error says what each needs and what the
    nodes have."""
    with pytest.raises(RolloutError, match=r"cannot hold 1 of 1 rollout workers.*needs \{'CPU': 4\} on one node"):
        remote_engines("vllm", 4, start_timeout_s=1)  # no node can ever hold it: the wait is not what is checked


@pytest.mark.vllm
def test_a_weight_group_on_a_taken_port_is_refused_before_training(cluster):
    """trainer.async_rollout.weight_group_port on a port another process listens on: the group could not form, and
    the rollout workers' start says so (naming the port and the setting) before any worker or engine starts."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((ray.util.get_node_ip_address(), 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RolloutError, match=rf"weight group.s port .*:{port} is taken.*weight_group_port"):
            remote_engines("vllm", 1, weight_transfer="collective", group_port=port)


# A variant (marker `full`, make test-all; 26-32 s): make test keeps its parts: rollout workers giving the synchronous
# run exactly (tests/trainer/test_async_workers.py), a worker on another node taking syncs over the group (above), and
# the demo learning with a vLLM rollout worker synced over the group (tests/trainer/test_async_fit.py).
@pytest.mark.vllm
@pytest.mark.full
def test_the_async_run_on_the_cluster_takes_the_single_node_runs_steps(cluster, tiny_model_path, tmp_path):
    """The asynchronous placement at max_staleness=0 with its rollout worker on another node (vLLM, weights over the
    gloo group after every step) trains on the samples the single-node synchronous run draws: the same metrics
    and the same weights after the last step, every weights probe in sync."""
    from tests.trainer.test_async_fit import ASYNC, CORRECTED, _weights, _without_async
    from tests.trainer.test_fit import base_args
    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit
    from vlmrl.trainer.metrics import read_metrics

    common = ("rollout.name=vllm", "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
              "trainer.val_before_train=false", *CORRECTED)
    fit(load_config(base_args(tiny_model_path, tmp_path / "single", *common)))
    fit(load_config(base_args(tiny_model_path, tmp_path / "cluster", *common, ASYNC,
                              "trainer.async_rollout.max_staleness=0", "trainer.async_rollout.rollout_workers=1",
                              "trainer.async_rollout.weight_transfer=collective")))
    single, spread = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("single", "cluster"))
    assert [_without_async(r) for r in spread] == [_without_async(r) for r in single]
    assert all(r["weight_probe/in_sync"] == 1.0 for r in spread)
    assert _weights(tmp_path / "cluster", 2) == _weights(tmp_path / "single", 2)


def test_a_group_of_the_wrong_size_is_one_named_error_never_a_hang(worker, hf):
    """A group formed for more engine ranks than the engine has (two more): the rendezvous
    waits for a rank that never comes, and forming it fails at the group's deadline with one error naming the group
    and its size, never a hang. SGLang's engine then joins the right group, which carries a sync that leaves the
    weights bit for bit; vLLM's refuses every later call, saying why (its multiprocess executor's replies to the
    failed join would answer the next call): the run then stops, or restarts the worker. (The last test on each
    engine: it may leave the vLLM worker unusable.)"""
    started = worker.weights_checksums()
    timeout = worker.sender.timeout_s
    worker.sender.timeout_s = 2  # the rendezvous waits this long for the ranks that never come
    try:
        world = 1 + worker.tp + 2
        with pytest.raises(RuntimeError, match=rf"(?s)weight group vlmrl-weights-\w+ .*\({world} ranks, gloo\)"):
            worker.sender.form(worker.workers, [worker.tp + 2])
    finally:
        worker.sender.timeout_s = timeout
    if worker.name == "vllm":
        with pytest.raises(RolloutError, match=r"the engine is unusable \(joining weight group vlmrl-weights-\w+ "
                                               r"failed"):
            worker.weights_checksums()
        return
    worker._form_group()
    worker.update_weights(list(clone_state(hf.model).items()))
    assert worker.weights_checksums() == started


# On SGLang's worker (TP 1): a restart is what the test costs, and vLLM's TP 2 engine took 60 s of make test to start
# again where SGLang's takes about 30. The restart and resend are RemoteEngines', the same for either engine; the
# engine's own side of a collective sync is tested on both above.
@pytest.mark.sglang
@pytest.mark.parametrize("worker", ["sglang"], indirect=True)
def test_a_worker_killed_mid_sync_is_restarted_and_gets_the_whole_sync(worker, hf, batch):
    """SIGKILL of the worker's process after the first bucket of a collective sync: the worker is started again in
    its placement group, the group formed again and the whole sync sent again; every engine then gives what
    transformers gives with the new weights (the weight probe's check on each worker), one restart counted; none of
    the killed engine's processes is left (SGLang's scheduler ends with its parent)."""
    original = clone_state(hf.model)
    moved = scaled_mlps(original)
    import psutil

    pid, plan, killed = worker.infos[0]["pid"], worker.sync_plan, []
    engine_processes = psutil.Process(pid).children(recursive=True)
    assert engine_processes, "SGLang's scheduler runs in a process of its own"

    def killing_plan(*args, **kwargs):
        sync = plan(*args, **kwargs)

        def buckets():
            for index, bucket in enumerate(sync.buckets):
                if index == 1 and not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                yield bucket

        return replace(sync, buckets=buckets())

    worker.sync_plan = killing_plan
    try:
        worker.update_weights(moved)
    finally:
        del worker.sync_plan
    try:
        assert killed and worker.restarts == 1 and worker.infos[0]["pid"] != pid
        _, alive = psutil.wait_procs(engine_processes, timeout=30)
        assert not alive, f"the killed worker's engine processes live on: {[p.pid for p in alive]}"
        hf.update_weights(moved)
        expected = hf.generate(batch[:4], GREEDY)
        for results in worker.generate_on_each(batch[:4], GREEDY):
            problems = greedy_problems(expected, results, worker.name, LOGPROB_TOL)
            assert not problems, "the restarted worker is not on the synced weights:\n" + "\n".join(problems)
    finally:
        hf.update_weights(original.items())
        worker.update_weights(list(original.items()))


# A variant (marker `full`, make test-all; about 40 s): make test keeps the kill mid-sync with the driver as the sender
# (above) and the training ranks' sync (test_training_ranks_send_each_sync_over_the_group_themselves).
@pytest.mark.full
@pytest.mark.sglang
@pytest.mark.parametrize("worker", ["sglang"], indirect=True)
def test_a_worker_killed_mid_sync_from_the_training_ranks_is_restarted_and_gets_the_whole_sync(worker, hf, batch):
    """SIGKILL of the worker's process when its engine has taken the first bucket that training rank 0 broadcast:
    the worker is started again, the group formed again with rank 0 as its sender and the ranks gather and send the
    whole sync again: the engine then holds bitwise the ranks' weights (the tiny model's: its start checksum) and
    gives transformers' outputs on them, one restart counted."""
    started, original = worker.weights_checksums(), clone_state(hf.model)
    worker.restarts_left, restarts = 1, worker.restarts  # the module's other kill may have used the worker's restart
    actor = training_ranks(worker.model_path)
    pid, call, killed = worker.infos[0]["pid"], worker.sender.call, []

    def killing_call(ref, index, what):
        out = call(ref, index, what)
        if what == "receiving weights" and not killed:  # the first bucket landed: the next one meets a dead engine
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return out

    try:
        worker.update_weights(scaled_mlps(original))
        worker.send_from(actor)
        worker.sender.call = killing_call
        actor.sync_weights(worker)
        assert killed and worker.restarts == restarts + 1 and worker.infos[0]["pid"] != pid
        assert worker.weights_checksums() == started
        problems = greedy_problems(hf.generate(batch[:4], GREEDY), worker.generate(batch[:4], GREEDY), worker.name,
                                   LOGPROB_TOL)
        assert not problems, "\n".join(problems)
    finally:
        worker.sender.call = call
        worker.send_from(None)
        actor.close()


# A variant (marker `full`, make test-all): two SGLang workers and a restart cost about 80 s of make test's 20
# minutes. make test keeps the restart during a sync (above) and between object-store syncs (tests/trainer/
# test_async_workers.py, tests/cluster/test_node_loss.py).
@pytest.mark.full
@pytest.mark.sglang
def test_a_worker_restarted_between_collective_syncs_sits_out_until_the_next_sync(cluster, hf, batch):
    """Two SGLang workers (TP 1), weights over the group. Worker 1 killed after a sync: the next generation starts
    it again, but the group stores no copy of the weights to give it, so its requests go to worker 0: every result
    equals what transformers gives on the synced weights and names engine 0, the engine that made it. Until the next
    sync the weight probe's question skips it (it answers []) and its checksum is the start weights'; the next sync
    brings it back, and the requests are cut over both engines again."""
    original = clone_state(hf.model)
    moved = scaled_mlps(original)
    engines = remote_engines("sglang", 1, workers=2, weight_transfer="collective")
    try:
        started = engines.weights_checksums()
        engines.update_weights(moved)
        synced = engines.weights_checksums()
        assert synced[0] == synced[1] != started[1], (started, synced)
        hf.update_weights(moved)
        expected = hf.generate(batch[:4], GREEDY)

        os.kill(engines.infos[1]["pid"], signal.SIGKILL)
        results = engines.generate(batch[:4], GREEDY)
        assert engines.restarts == 1 and engines.current() == [0]
        assert [r.engine for r in results] == [0] * len(results), "the results name the engine that made them"
        problems = greedy_problems(expected, results, engines.name, LOGPROB_TOL)
        assert not problems, "a restarted worker without the synced weights generated:\n" + "\n".join(problems)
        each = engines.generate_on_each(batch[:1], GREEDY)
        assert len(each[0]) == 1 and each[1] == [], "the probe asks only the engines that hold the last sync"
        assert engines.weights_checksums() == [synced[0], started[1]]

        engines.update_weights(list(original.items()))
        hf.update_weights(original.items())
        back = engines.generate(batch[:4], GREEDY)
        assert engines.current() == [0, 1] and [r.engine for r in back] == [0, 0, 1, 1]
        problems = greedy_problems(hf.generate(batch[:4], GREEDY), back, engines.name, LOGPROB_TOL)
        assert not problems, "\n".join(problems)
    finally:
        hf.update_weights(original.items())
        engines.close()
