"""The asynchronous placement (trainer.async_rollout.enable): the engine generates the next steps' batches on a
rollout thread of its own while the trainer updates on the last one.

    rollout thread:  [batch s+1 (weights v)] [batch s+2 (weights v+1)] ...      -> bounded buffer (buffer_steps)
    trainer:          take s -> old logprobs -> update -> sync (v+1) -> probe -> take s+1 ...

- **Staleness.** Every batch carries the version of the weights it was sampled with (the step whose update the
  engine held; `policy_version` of its samples). The batch for step s starts only once the engine holds step
  s - 1 - max_staleness's weights or newer, so the trainer (at step s - 1's weights when it takes it) never consumes
  a batch more than max_staleness steps old. At max_staleness = 0 every batch starts after the sync before it: the
  synchronous loop's schedule, and its numbers exactly.
- **The engine is shared.** One lock (`engine`) orders the rollout thread's generate calls with the trainer's weight
  sync, weights probe and validation: a sync waits for the batch in flight, which finishes on the old weights (its
  version says so) and is counted (`async/sync_wait_s`); validation runs on one fixed version.
- **Staged syncs** (trainer.async_rollout.staged_sync). The trainer does not wait for the engine after its update:
  it stages a copy of the new weights (`stage`) and goes on; the rollout thread loads the newest staged weights
  (`load`) before it starts its next batch, or at the next segment boundary of the batch in flight, so a batch's
  version is still the weights it was sampled with. The steps that validate or save sync as without staging, and
  drop what is staged (`unstage`): validation and checkpoints see a landed sync.
- **Checkpoints.** The rollout thread draws the prompts. A checkpoint keeps the batches made and not yet taken
  (`pending`, BUFFER_FILE: their samples and the versions that sampled them) and the data position after the last
  of them; a resumed run trains on those first, as the uninterrupted run would have, and the thread draws on after
  them. A batch in flight at the checkpoint is not kept: its prompts are drawn again (the data position is the one
  after the last kept batch). None lost, none twice.
- **Failures.** An error on the rollout thread reaches the trainer at its next take, with the thread's traceback
  as its cause; a batch that does not come within rollout.timeout_s is an error too. Never a hang.

The engine runs in this process on its own thread (the backend's calls already run on an engine thread under a
deadline); on a 2-core CPU the rollout then takes one core and the trainer the other.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlmrl.atomic import write_text_atomically
from vlmrl.types import RolloutResult

logger = logging.getLogger(__name__)


def staleness(step: int, version: int) -> int:
    """How many updates older than the trainer's weights a batch is: the trainer takes step `step`'s batch holding
    step `step - 1`'s weights, and the batch was sampled with step `version`'s. The rollout thread starts a batch
    only where this is within max_staleness (`AsyncRollout`)."""
    return step - 1 - version


class RolloutWorkerError(RuntimeError):
    """The rollout thread failed, or gave no batch within the deadline."""


@dataclass
class Produced:
    """One batch the rollout thread made for training step `step`."""

    step: int
    version: int
    """The step whose weights the engine held when it generated the batch."""
    rollout: Any
    data_state: dict
    """The data position after drawing this batch's prompts (what a checkpoint after `step` saves)."""
    generate_s: float
    waited_s: float
    """How long the rollout thread waited (for newer weights or buffer room) before starting this batch."""


@dataclass
class _Failed:
    step: int
    error: BaseException


@dataclass
class AsyncRollout:
    """The rollout thread and its buffer. `produce(step, version)` makes step `step`'s batch on the engine (called on
    the rollout thread, under `engine`); `data_state()` reads the data position after it."""

    produce: Callable[[int, int], Any]
    data_state: Callable[[], dict]
    max_staleness: int
    buffer_steps: int
    timeout_s: float
    first_step: int
    """The first step the thread makes a batch for (the run's step + 1)."""
    engine_version: int
    """The step whose weights the engine holds (moved by `synced`)."""
    last_step: int
    engine: threading.RLock = field(default_factory=threading.RLock)
    consumed_data_state: dict | None = None
    """The data position after the last consumed batch (None before the first)."""
    preload: list[Produced] = field(default_factory=list)
    """Batches a checkpoint kept (steps first_step - len(preload) ..): taken before the thread's own."""
    load: Callable[[int, Any], bool] | None = None
    """Staged syncs: loads (version, weights) `stage` was given into the engine (called on the rollout thread,
    holding `engine`); returns whether the engine took them (it then holds that version)."""

    def __post_init__(self) -> None:
        self.in_flight = False
        """A batch is being generated (read by the trainer before it takes the engine)."""
        self.interrupts = 0
        """Trainer calls (syncs, probes, validations) let in between two segments of a batch in flight."""
        self._waiting = 0  # trainer calls waiting for the engine (`exclusive`)
        self._waiting_lock = threading.Lock()
        self._staged: tuple[int, Any] | None = None  # (version, weights) staged and not loaded yet
        self.staged_loads = 0
        """Staged weights the engine loaded (a newer staging replaces one not loaded yet: not counted)."""
        self.staged_replaced = 0
        """Staged weights replaced by newer ones before the engine loaded them."""
        self.load_s = 0.0
        """Seconds the staged loads took (on the rollout thread)."""
        self._buffer: queue.Queue = queue.Queue(maxsize=max(self.buffer_steps, len(self.preload)))
        for item in self.preload:
            self._buffer.put(item)
        self._version = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlmrl-rollout", daemon=True)
        self._thread.start()

    # ---- the rollout thread

    def _run(self) -> None:
        step = self.first_step
        try:
            while step <= self.last_step and not self._stop.is_set():
                begin = time.perf_counter()
                while True:  # the weights this batch may be sampled with at the oldest, staged ones loaded first
                    if self._staged is not None:
                        with self.engine:
                            self._load_staged()
                    with self._version:
                        if staleness(step, self.engine_version) <= self.max_staleness or self._stop.is_set():
                            break
                        if self._staged is None:
                            self._version.wait(0.2)
                if self._stop.is_set():
                    return
                waited = time.perf_counter() - begin
                with self.engine:
                    self._load_staged()  # staged while this thread waited for the engine
                    version = self.engine_version
                    start = time.perf_counter()
                    self.in_flight = True
                    try:
                        rollout = self.produce(step, version)
                    finally:
                        self.in_flight = False
                    made = Produced(step, version, rollout, self.data_state(), time.perf_counter() - start, waited)
                if not self._put(made):
                    return
                step += 1
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
            self._put(_Failed(step, error))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._buffer.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    # ---- the trainer's side

    def take(self, step: int) -> tuple[Produced, dict[str, float]]:
        """Step `step`'s batch and the async/* metrics of taking it. Raises RolloutWorkerError when the rollout
        thread failed or gave nothing within timeout_s."""
        depth = self._buffer.qsize()
        begin = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = self._buffer.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._buffer.empty():
                    raise RolloutWorkerError(f"step {step}: the rollout thread ended without a batch") from None
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(f"step {step}: no batch from the rollout thread within rollout.timeout_s="
                                             f"{self.timeout_s:g} s") from None
        if isinstance(item, _Failed):
            raise RolloutWorkerError(f"the rollout thread failed making step {item.step}'s batch: "
                                     f"{type(item.error).__name__}: {item.error}") from item.error
        if item.step != step:
            raise RolloutWorkerError(f"the rollout thread made step {item.step}'s batch where step {step}'s was due")
        stale = staleness(step, item.version)
        if not 0 <= stale <= self.max_staleness:  # the gate above makes this impossible: a bug if it happens
            raise RolloutWorkerError(f"step {step}: a batch sampled with step {item.version}'s weights is {stale} "
                                     f"steps stale, beyond trainer.async_rollout.max_staleness={self.max_staleness}")
        self.consumed_data_state = item.data_state
        return item, {"async/staleness": float(stale), "async/buffer_depth": float(depth),
                      "async/trainer_wait_s": time.perf_counter() - begin,
                      "async/rollout_wait_s": item.waited_s, "async/generate_s": item.generate_s}

    @contextlib.contextmanager
    def exclusive(self):
        """The engine to the trainer while the block runs: after the batch in flight, or (interrupt_tokens) at its
        next segment boundary, where the rollout thread lets waiting calls in (`let_in`)."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            with self.engine:
                yield
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def let_in(self) -> int:
        """Called by the rollout thread between two segments of a batch (holding the engine): loads staged weights
        and lets the trainer's waiting calls run first, then returns the version of the weights the engine holds."""
        let = self._staged is not None
        if let:
            self._load_staged()
        if self._waiting > 0:
            let = True
            self.engine.release()
            try:
                while self._waiting > 0 and not self._stop.is_set():
                    time.sleep(0.002)
            finally:
                self.engine.acquire()
        self.interrupts += let
        return self.engine_version

    def pending(self) -> list[Produced]:
        """The batches made and not taken yet, in step order (what a checkpoint keeps); the thread goes on."""
        with self._buffer.mutex:
            items = list(self._buffer.queue)
        out = []
        for item in items:
            if not isinstance(item, Produced):
                break  # a failure: the trainer raises it at its next take
            out.append(item)
        return out

    def stage(self, version: int, weights: Any) -> None:
        """Staged sync: step `version`'s weights (a copy the trainer no longer writes to) for the engine, loaded by
        the rollout thread before its next batch or at the next segment boundary. Returns at once."""
        if self.load is None:
            raise RuntimeError("AsyncRollout.stage needs `load` to put staged weights into the engine")
        with self._version:
            if self._staged is not None:
                self.staged_replaced += 1
            self._staged = (version, weights)
            self._version.notify_all()

    def unstage(self) -> None:
        """Drop the staged weights not loaded yet (the caller holds `engine` and syncs newer ones itself)."""
        with self._version:
            if self._staged is not None:
                self.staged_replaced += 1
            self._staged = None

    def _load_staged(self) -> None:
        """Load the staged weights (the caller holds `engine`); the engine's version moves when it took them."""
        with self._version:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        begin = time.perf_counter()
        if self.load(*staged):
            self.staged_loads += 1
            self.synced(staged[0])
        self.load_s += time.perf_counter() - begin

    def synced(self, version: int) -> None:
        """The engine now holds step `version`'s weights: the rollout thread may start the batches they allow."""
        with self._version:
            self.engine_version = version
            self._version.notify_all()

    def close(self) -> None:
        """Stop the rollout thread (a batch in flight finishes first, within rollout.timeout_s)."""
        self._stop.set()
        with self._version:
            self._version.notify_all()
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            logger.warning("the rollout thread did not stop within %.0f s; leaving it (a daemon thread)",
                           self.timeout_s)


CONSUMED_FILE = "async_consumed.jsonl"
"""OUTPUT_DIR/async_consumed.jsonl: one line per step the trainer trained on in the asynchronous placement: the step,
the version of the weights its batch was sampled with, its staleness and its prompts' dataset rows."""


def append_consumed(output_dir, step: int, version: int, rows: list[int], results: list[RolloutResult]) -> None:
    """One line of CONSUMED_FILE (a resumed run truncates it to its checkpoint, as metrics.jsonl); `responses` is a
    digest of the batch's sampled tokens (`responses_digest`)."""
    line = json.dumps({"step": step, "engine_version": version, "staleness": staleness(step, version), "rows": rows,
                       "responses": responses_digest(results)})
    with open(Path(output_dir) / CONSUMED_FILE, "a") as handle:
        handle.write(line + "\n")


def staleness_counts(output_dir) -> collections.Counter:
    """{staleness: batches} of the steps CONSUMED_FILE holds (a resumed run's: those up to its checkpoint)."""
    path = Path(output_dir) / CONSUMED_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return collections.Counter(int(json.loads(line)["staleness"]) for line in lines if line.strip())


def responses_digest(results: list[RolloutResult]) -> str:
    """sha256 of a batch's sampled token ids and their logprobs, request-major: two batches with the same digest
    trained on the same samples."""
    digest = hashlib.sha256()
    for r in results:  # the raw bytes: no text form of every logprob on the trainer's path each step
        digest.update(len(r.response_ids).to_bytes(8, "little"))
        digest.update(np.asarray(r.response_ids, dtype=np.int64).tobytes())
        digest.update(np.asarray(r.response_logprobs, dtype=np.float64).tobytes())
        digest.update(r.finish_reason.encode() + b"\0")
    return digest.hexdigest()


BUFFER_FILE = "async_buffer.json"
"""In a checkpoint: the batches the rollout thread had made and the trainer not yet taken, each with its step, the
version of the weights that sampled it, its dataset rows, the data position after it and the engine's results
(token ids, logprobs, finish reasons; JSON, no pickle). A resumed run trains on them first."""
BUFFER_FORMAT = 1


def buffer_records(items: list[Produced]) -> list[dict]:
    """What `write_buffer` keeps of each buffered batch."""
    return [{"step": p.step, "version": p.version, "rows": list(p.rollout.rows), "data_state": p.data_state,
             "generate_s": p.generate_s,
             "results": [{"uid": r.uid, "sample_index": r.sample_index, "response_ids": list(r.response_ids),
                          "response_logprobs": list(r.response_logprobs), "finish_reason": r.finish_reason}
                         for r in p.rollout.results]}
            for p in items]


def write_buffer(folder: Path, records: list[dict]) -> None:
    write_text_atomically(Path(folder) / BUFFER_FILE, json.dumps({"format": BUFFER_FORMAT, "batches": records}))


def read_buffer(folder: Path) -> list[dict] | None:
    """The buffered batches of a checkpoint (results as RolloutResults), or None when it kept none (a synchronous
    run's, or one written before checkpoints kept the buffer)."""
    path = Path(folder) / BUFFER_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("format") != BUFFER_FORMAT:
        raise ValueError(f"{path}: format {saved.get('format')!r}; this vlmrl reads format {BUFFER_FORMAT}")
    for record in saved["batches"]:
        record["results"] = [RolloutResult(**r) for r in record["results"]]
    return saved["batches"]
