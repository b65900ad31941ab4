"""The placement: where a step's batch comes from and how the trainer's new weights reach the engine, behind one
interface the loop calls.

    Colocated (the synchronous loop): the engine generates step s's batch with step s - 1's weights; after the
        update the trainer syncs the weights into it, waits for them to land, and probes them.
    Asynchronous (trainer.async_rollout.enable): a rollout thread generates the next steps' batches into a bounded
        buffer while the trainer updates (`vlmrl.trainer.async_rollout`: the staleness gate, staged syncs, segments);
        a sync is staged (the thread loads it before its next batch) or waits for the batch in flight.

The loop asks a placement for a step's rollout (`collect`), to sync and probe (`sync`), for the engine to itself
while it validates (`engine`), and for what a checkpoint keeps of it (`data_state`, `checkpoint_writer`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from vlmrl.config import Config
from vlmrl.data.dataset import build_requests
from vlmrl.rollout.base import DTYPES
from vlmrl.trainer.async_rollout import (
    BUFFER_FILE,
    AsyncRollout,
    Produced,
    append_consumed,
    buffer_records,
    read_buffer,
    staleness,
    staleness_counts,
    write_buffer,
)
from vlmrl.trainer.collect import agent_rollout, finish_rollout, plain_rollout, training_sampling
from vlmrl.trainer.run import PhaseTimer, Placement, Rollout, Run, due
from vlmrl.types import SamplingParams

logger = logging.getLogger(__name__)


class ColocatedPlacement:
    """The synchronous placement (`vlmrl.trainer.run.Placement`): the engine generates each step's batch on the
    weights of the step before, and every sync is waited for and probed."""

    def collect(self, run: Run, step: int, sampling: SamplingParams) -> Rollout:
        """Step `step`'s rollout: one engine call over the next batch of prompts, or the agent loop's turns."""
        if run.parts.agent is None:
            return plain_rollout(run, step, sampling)
        return agent_rollout(run, step, sampling)

    def sync(self, run: Run, step: int, timer: PhaseTimer, step_metrics: Callable[[], dict[str, float]]
             ) -> dict[str, float]:
        """Step `step`'s weights into the engine (timing/weight_sync), then the weights probe of what landed
        (timing/weight_probe). `step_metrics()` gives the step's metrics once the sync is done (its throughput
        counts rollout -> weight sync, as EasyR1's); returns them with the probe's."""
        with timer("weight_sync"):
            sync_engine(run, step)
        metrics = step_metrics()
        if run.probe is not None:
            with timer("weight_probe"):
                metrics.update(run.probe(run.actor, run.parts.backend, step, run.engine_version))
        return metrics

    def engine(self) -> contextlib.AbstractContextManager:
        """The engine to the trainer while the block runs (validation on one fixed version of the weights)."""
        return contextlib.nullcontext()

    def data_state(self, run: Run) -> dict:
        """The data position after the last batch trained on."""
        return run.sampler.state_dict()

    def checkpoint_writer(self) -> Callable[[Path], None] | None:
        """What a checkpoint keeps of the placement beyond the data position (written into its folder), or None."""
        return None

    def restore(self, run: Run, checkpoint: Path) -> None:
        """Take back what `checkpoint_writer` kept in `checkpoint`."""

    def close(self) -> None:
        pass


class AsynchronousPlacement(ColocatedPlacement):
    """trainer.async_rollout.enable: batches made ahead on a rollout thread (`AsyncRollout`, started at step 1's
    collect), each carrying the version of the weights that sampled it, within trainer.async_rollout.max_staleness;
    syncs staged (staged_sync) or waiting for the batch in flight; the unconsumed batches kept in checkpoints."""

    def __init__(self) -> None:
        self.thread: AsyncRollout | None = None
        self.restored: list[Produced] = []
        """The batches a checkpoint kept (`restore`): the thread's buffer starts with them."""
        self.dropped_batches = 0
        """Kept batches the resumed settings do not allow, for the next step's async/dropped_batches."""
        self.staleness_counts: collections.Counter | None = None
        """{staleness: batches trained on} over the run so far (async/staleness_hist/*), read from CONSUMED_FILE at
        the first asynchronous step (a resumed run's counts the steps before its checkpoint)."""

    def collect(self, run: Run, step: int, sampling: SamplingParams) -> Rollout:
        """Step `step`'s batch from the rollout thread (made maybe while the last update ran), with its async/*
        metrics; the thread starts here at the first step, once the format warm-up and step 0's validation are
        done."""
        a = run.config.trainer.async_rollout
        if self.thread is None:
            self.thread = self._start(run, step)
        produced, metrics = self.thread.take(step)
        if a.rollout_workers > 0:  # RemoteEngines: workers started again after dying
            metrics["async/worker_restarts"] = float(run.parts.backend.restarts)
        if a.interrupt_tokens > 0:
            metrics["async/interrupts"] = float(self.thread.interrupts)  # over the run
        if a.staged_sync:  # over the run
            metrics.update({"async/staged_loads": float(self.thread.staged_loads),
                            "async/staged_replaced": float(self.thread.staged_replaced),
                            "async/staged_load_s": self.thread.load_s})
        if self.dropped_batches:  # kept by the checkpoint, beyond the resumed bound: drawn again
            metrics["async/dropped_batches"], self.dropped_batches = float(self.dropped_batches), 0
        if self.staleness_counts is None:
            self.staleness_counts = staleness_counts(run.output_dir)
        self.staleness_counts[int(metrics["async/staleness"])] += 1
        # the run's staleness histogram so far: batches trained on at each staleness 0..max_staleness
        metrics.update({f"async/staleness_hist/{k}": float(self.staleness_counts.get(k, 0))
                        for k in range(a.max_staleness + 1)})
        produced.rollout.metrics.update(metrics)
        append_consumed(run.output_dir, step, produced.version, [r.index for r in produced.rollout.requests],
                        produced.rollout.results)
        return produced.rollout

    def _start(self, run: Run, step: int) -> AsyncRollout:
        a = run.config.trainer.async_rollout
        preload, self.restored = self.restored, []
        if preload:  # the thread draws on after the batches a checkpoint kept
            run.sampler.load_state_dict(preload[-1].data_state)

        def produce(s: int, version: int) -> Rollout:  # on the rollout thread, holding the engine
            return plain_rollout(run, s, training_sampling(run.config, s), policy_version=version,
                                 segment_tokens=a.interrupt_tokens, between=lambda: self.thread.let_in())

        return AsyncRollout(  # its thread starts at once; `between` runs only after a first segment, once it is set
            produce=produce, data_state=run.sampler.state_dict, max_staleness=a.max_staleness,
            buffer_steps=a.buffer_steps, timeout_s=run.config.rollout.timeout_s, first_step=step + len(preload),
            engine_version=run.engine_version, last_step=run.total_steps, preload=preload,
            load=lambda version, weights: sync_engine(run, version, weights))

    def sync(self, run: Run, step: int, timer: PhaseTimer, step_metrics: Callable[[], dict[str, float]]
             ) -> dict[str, float]:
        """A staged sync (trainer.async_rollout.staged_sync, but for the steps that validate or save, and the last):
        a copy of the weights handed to the rollout thread, no wait. Else the sync and the probe of what it left,
        with no batch of the rollout thread in between: after the batch in flight, which finishes on the old weights
        first, or (interrupt_tokens) at its next segment boundary, from where it goes on with the new ones."""
        in_flight = self.thread.in_flight
        if run.config.trainer.async_rollout.staged_sync and not syncs_in_full(run, step):
            with timer("weight_sync"):
                self.thread.stage(step, staged_weights(run))
            return {**step_metrics(), "async/sync_wait_s": 0.0, "async/sync_found_in_flight": float(in_flight),
                    "async/sync_staged": 1.0}
        waiting = time.perf_counter()
        with self.engine():
            waited = time.perf_counter() - waiting  # for the batch in flight
            self.thread.unstage()  # older than what this sync loads
            metrics = super().sync(run, step, timer, step_metrics)
            metrics.update({"async/sync_wait_s": waited, "async/sync_found_in_flight": float(in_flight)})
            self.thread.synced(run.engine_version)
        return metrics

    def engine(self) -> contextlib.AbstractContextManager:
        """After the rollout thread's batch in flight, or at its next segment boundary (interrupt_tokens)."""
        return self.thread.exclusive() if self.thread is not None else contextlib.nullcontext()

    def data_state(self, run: Run) -> dict:
        """After the last batch trained on: the rollout thread may have drawn further."""
        if self.thread is not None and self.thread.consumed_data_state is not None:
            return dict(self.thread.consumed_data_state)
        return run.sampler.state_dict()

    def checkpoint_writer(self) -> Callable[[Path], None] | None:
        """The batches made and not trained on yet (BUFFER_FILE), as they are when this is called."""
        if self.thread is None:
            return None
        records = buffer_records(self.thread.pending())
        return lambda folder: write_buffer(folder, records)

    def restore(self, run: Run, checkpoint: Path) -> None:
        records = read_buffer(checkpoint)
        if records is not None:
            self.restored, self.dropped_batches = restore_buffer(run, records, checkpoint)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()


def start_placement(config: Config) -> Placement:
    """The run's placement (trainer.async_rollout.enable)."""
    return AsynchronousPlacement() if config.trainer.async_rollout.enable else ColocatedPlacement()


def sync_engine(run: Run, step: int, weights: list[tuple[str, torch.Tensor]] | None = None) -> bool:
    """Step `step`'s weights into the engine (`weights`: a staged copy of them; None: the actor's own). A sync that
    never reached it (the backend counted no weight load) is said, and the engine keeps its version: the next
    step's drift samples then show the stale weights. Returns whether it landed."""
    backend = run.parts.backend
    loads = backend.weight_loads
    if weights is None:
        run.actor.sync_weights(backend)
    else:
        backend.update_weights(weights)
    if backend.weight_loads > loads:
        run.engine_version = step
        return True
    logger.warning("step %d: the weight sync loaded nothing into the %s engine: it still holds step %d's weights",
                   step, backend.name, run.engine_version)
    return False


def syncs_in_full(run: Run, step: int) -> bool:
    """With trainer.async_rollout.staged_sync: whether step `step` still waits for its sync (and probes it), as the
    steps that validate or save, and the last one, do."""
    t = run.config.trainer
    return (step == run.total_steps or due(t.save_freq, step, run.total_steps)
            or (due(t.test_freq, step, run.total_steps) and run.parts.val_data is not None))


def staged_weights(run: Run) -> list[tuple[str, torch.Tensor]]:
    """A copy of the actor's weights in the engine's dtype, which the next update does not write to: what a staged
    sync hands the rollout thread (trainer.async_rollout.staged_sync)."""
    backend = run.parts.backend
    dtype = DTYPES[backend.dtype]
    return [(name, tensor.detach().to(dtype=dtype, copy=True)) for name, tensor in run.actor.named_tensors()]


def restore_buffer(run: Run, records: list[dict], checkpoint: Path) -> tuple[list[Produced], int]:
    """The batches a checkpoint kept of the asynchronous placement's buffer (`write_buffer`), rebuilt from their
    rows and results: the resumed run trains on them with the versions that sampled them, as the uninterrupted run
    would have. A batch the resumed settings no longer allow (older than max_staleness) and every one after it are
    dropped, counted in the log, and drawn again. Returns the kept batches and how many were dropped."""
    kept: list[Produced] = []
    bound, dropped = run.config.derived.max_staleness, 0
    for record in records:
        step = run.step + 1 + len(kept)
        if record["step"] != step or staleness(step, record["version"]) > bound:
            logger.warning("%s: %d of the %d buffered batches are dropped (step %d's, sampled with step %d's weights, "
                           "is beyond trainer.async_rollout.max_staleness=%d or out of order): drawn again",
                           checkpoint, len(records) - len(kept), len(records), record["step"], record["version"],
                           bound)
            dropped = len(records) - len(kept)
            break
        built = build_requests(run.parts.processor, run.train_data, record["rows"])
        results = record["results"]
        n = len(results) // max(1, len(built.requests))
        if not built.requests or n * len(built.requests) != len(results):
            raise ValueError(f"{checkpoint / BUFFER_FILE}: step {step}'s batch has {len(results)} results for "
                             f"{len(built.requests)} requests of rows {record['rows']}: the data changed since")
        results = [replace(r, uid=built.requests[i // n].uid) for i, r in enumerate(results)]  # uids are per run
        rollout = finish_rollout(run, built, record["rows"], results, record["version"], record["version"])
        kept.append(Produced(step, record["version"], rollout, record["data_state"], record["generate_s"], 0.0))
    return kept, dropped
