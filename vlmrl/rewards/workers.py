"""Reward worker processes: a per-sample time limit that really stops a hung reward function.

A Python thread cannot be killed, so with a limit (`reward.timeout_s`) the reward function runs in a small persistent
pool of worker processes (`RewardWorkers(fn, num_workers)`), which the run's reward owns
(`vlmrl.rewards.scoring.RewardScorer`: started with the run's other parts, closed with them). Each worker gets one
contiguous chunk of a batch and answers per sample; the parent times each sample from the previous answer, so an
overrunning sample is known exactly: it scores 0 with `timed_out`, its worker is killed (SIGKILL to its process group)
and a fresh one scores the rest. Workers are fresh interpreters (`subprocess`, not fork: a trainer holds engine threads
and CUDA state a forked child must not inherit), so `fn` travels by reference and must be defined at module level; its
module-level state lives per worker. The whole protocol: docs/data.md, "How the time limit is kept"."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import pickletools
import select
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from pathlib import Path

from vlmrl.rewards import registry
from vlmrl.rewards.base import Outcome, RewardFn, RewardInput, score_one
from vlmrl.utils.processes import kill_process_group
from vlmrl.utils.sequences import split_evenly

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""A worker must be ready within this: a fresh interpreter importing vlmrl.rewards and the user's reward file."""
_GATHER_S = 0.002
"""After a wake-up, wait this long before reading: answers of fast rewards pile up and one wake-up takes many (the
parent would otherwise wake once per sample; a wake-up costs more than scoring a simple sample)."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `vlmrl`, for the worker's sys.path
_BOOT = "import sys; sys.path.insert(0, sys.argv[2]); from vlmrl.rewards.workers import serve; serve(int(sys.argv[1]))"


class RewardWorkerError(RuntimeError):
    """A reward worker process did not start."""


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    ready: bool = False
    pending: deque[int] = field(default_factory=deque)
    """Batch positions sent to this worker (or waiting for it to be ready) and not answered yet, in scoring order."""
    deadline: float = 0.0
    """time.monotonic() by which its next message must come: being ready, then each sample's answer."""


class RewardWorkers:
    """`num_workers` processes scoring with `fn`: `score(items, timeout_s)` gives one Outcome per item, in order;
    `close()` kills them (safe to call twice; also called at exit), and a closed pool refuses to score.

    Starting checks that `fn` can run in a worker (ValueError saying what to change when it cannot)."""

    def __init__(self, fn: RewardFn, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers} must be >= 1")
        self.fn, self.num_workers = fn, num_workers
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            self._payload = pickle.dumps(fn)
        except Exception as err:  # lambdas, closures, objects holding locks...
            raise ValueError(_cannot_send(self.name, f"{type(err).__name__}: {err}")) from None
        self._files = _reward_files(self._payload)
        self._lock = threading.Lock()
        self.closed = False
        self.workers: list[_Worker] = []
        atexit.register(self.close)  # a pool its owner never closed still ends with this process
        try:
            for _ in range(num_workers):  # they start side by side
                self.workers.append(self._start())
            for worker in self.workers:
                if not worker.conn.poll(STARTUP_TIMEOUT_S):
                    raise RewardWorkerError(f"reward worker pid {worker.process.pid} did not start within "
                                            f"{STARTUP_TIMEOUT_S:g} s")
                self._take_ready(worker)
        except BaseException:
            self.close()
            raise
        logger.info("reward: %d worker process(es) score with %s under a time limit (pids %s)", num_workers,
                    self.name, self.pids)

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self.workers]

    def score(self, items: Sequence[RewardInput], timeout_s: float) -> list[Outcome]:
        """Scores `items` with at most `timeout_s` seconds per sample; an overrunning sample's Outcome is timed_out."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the reward workers of {self.name} are closed (their run has ended): a run's "
                                   "reward scores only while the run is open")
            outcomes: list[Outcome | None] = [None] * len(items)
            try:
                for worker, chunk in zip(self.workers, split_evenly(range(len(items)), len(self.workers))):
                    worker.pending = deque(chunk)
                    if worker.process.poll() is not None:  # died while idle (killed from outside)
                        self._replace(worker)
                    elif worker.ready and worker.pending:
                        self._send(worker, items, timeout_s)
                while any(worker.pending for worker in self.workers):
                    self._step(items, outcomes, timeout_s)
            except BaseException:
                for worker in self.workers:  # they may hold half a batch (e.g. after Ctrl-C): the next call
                    _kill(worker)            # replaces them, as it replaces a worker killed from outside
                raise
            return outcomes

    def close(self) -> None:
        """Kills every worker (an idle one holds no state; a busy one's sample is abandoned); the pool is then closed
        for good."""
        atexit.unregister(self.close)
        self.closed = True
        for worker in self.workers:
            _kill(worker)
        self.workers = []

    # ---------------------------------------------------------------------------------------------------- internals

    def _start(self) -> _Worker:
        ours, theirs = Pipe()
        process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), _PACKAGE_ROOT],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        ours.send((list(sys.path), self._files, self._payload))
        return _Worker(process, ours, deadline=time.monotonic() + STARTUP_TIMEOUT_S)

    def _replace(self, worker: _Worker) -> None:
        """Kills the worker and starts a fresh one in its place; its pending samples go to the fresh one."""
        logger.debug("reward: replacing worker pid %d", worker.process.pid)
        _kill(worker)
        fresh = self._start()
        worker.process, worker.conn, worker.ready, worker.deadline = fresh.process, fresh.conn, False, fresh.deadline

    def _take_ready(self, worker: _Worker) -> None:
        """Reads a starting worker's first message: ready, or why it cannot score (raised)."""
        try:
            kind, detail = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            raise RewardWorkerError(f"reward worker pid {worker.process.pid} exited with code {code} while starting "
                                    "(its output is above)") from None
        if kind != "ready":  # detail: the worker's traceback; its last line says what failed
            raise ValueError(_cannot_send(self.name, detail.rstrip().splitlines()[-1]))
        worker.ready = True

    def _send(self, worker: _Worker, items: Sequence[RewardInput], timeout_s: float) -> None:
        chunk = [(position, items[position]) for position in worker.pending]
        try:
            worker.conn.send(chunk)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise ValueError(f"reward inputs of samples {chunk[0][0]}..{chunk[-1][0]} cannot be sent to a reward "
                             f"worker ({err}): set reward.timeout_s=0 to score in this process") from err
        except OSError:  # it died since we last looked: a fresh worker takes the chunk
            self._replace(worker)
            return
        worker.deadline = time.monotonic() + timeout_s

    def _step(self, items: Sequence[RewardInput], outcomes: list[Outcome | None], timeout_s: float) -> None:
        """Waits for answers or the earliest deadline, takes every answer there, then replaces overrunning workers."""
        busy = [worker for worker in self.workers if worker.pending]
        if wait([worker.conn for worker in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic())):
            time.sleep(_GATHER_S)
        for worker in busy:
            while worker.pending and _readable(worker.conn):  # an answer already here counts, even past the deadline
                self._take(worker, items, outcomes, timeout_s)
            if worker.pending and time.monotonic() > worker.deadline:
                if not worker.ready:
                    raise RewardWorkerError(f"reward worker pid {worker.process.pid} did not start within "
                                            f"{STARTUP_TIMEOUT_S:g} s")
                outcomes[worker.pending.popleft()] = Outcome(None, f"stopped after {timeout_s:g} s", timed_out=True)
                self._replace(worker)

    def _take(self, worker: _Worker, items: Sequence[RewardInput], outcomes: list[Outcome | None],
              timeout_s: float) -> None:
        """Reads one message: ready (then the chunk goes out), a sample's answer, or the end of a dead worker."""
        if not worker.ready:
            self._take_ready(worker)
            self._send(worker, items, timeout_s)
            return
        try:
            position, outcome = worker.conn.recv()
        except (EOFError, OSError):  # it died on its current sample: that one fails, a fresh worker does the rest
            code = worker.process.wait()
            outcomes[worker.pending.popleft()] = Outcome(
                None, f"the reward worker process died (exit code {code}) while scoring this sample")
            self._replace(worker)
            return
        expected = worker.pending.popleft()
        if position != expected:
            raise RuntimeError(f"reward worker pid {worker.process.pid} answered sample {position}, not {expected}")
        outcomes[position] = outcome
        worker.deadline = time.monotonic() + timeout_s


def _cannot_send(name: str, reason: str) -> str:
    return (f"reward function {name} cannot run in a reward worker process ({reason}). With reward.timeout_s set, "
            "the reward runs in worker processes, which import it by name: define it at module level in a file "
            "(reward.function=path/to/file.py:function) or an importable module, or set reward.timeout_s=0 to score "
            "in this process without a time limit")


def _reward_files(payload: bytes) -> list[str]:
    """The reward files (loaded by path) that the pickled function refers to: a worker loads them before unpickling."""
    names = {arg.split(" ")[0] for _, arg, _ in pickletools.genops(payload)
             if isinstance(arg, str) and arg.startswith(registry.USER_MODULE_PREFIX)}
    return [sys.modules[name].__file__ for name in sorted(names) if name in sys.modules]


def _readable(conn: Connection) -> bool:
    """A message (or the end of a dead worker) is waiting; select() on one socket, much cheaper than conn.poll()."""
    return bool(select.select([conn], [], [], 0)[0])


def _kill(worker: _Worker) -> None:
    worker.conn.close()
    kill_process_group(worker.process)  # the group: also any process the reward function started


# ---------------------------------------------------------------------------------------------------- worker side


def serve(fd: int) -> None:
    """Body of a worker process: set up from the first message, then score chunks, answering once per sample."""
    conn = Connection(fd)
    _exit_with_parent(os.getppid())
    try:
        path, files, payload = conn.recv()
        sys.path[:] = path  # the parent's, so `package.module:fn` imports here as it did there
        for file in files:
            registry.load_file(file)
        fn = pickle.loads(payload)  # the parent's own bytes over a private socket, never a file
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", ""))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the parent closed the pool
            return
        for position, item in chunk:
            conn.send((position, score_one(fn, item)))


def _exit_with_parent(parent: int) -> None:
    """Ends this worker when its parent is gone (killed without closing the pool), even in the middle of a sample."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="vlmrl-reward-parent-watch", daemon=True).start()
