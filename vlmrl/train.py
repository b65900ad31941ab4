"""`python -m vlmrl.train config=FILE.yaml key=value ...`: GRPO training (or validate-only with trainer.val_only=true).

Every key is listed in docs/config.md; `python -m vlmrl.config config=FILE.yaml ...` prints the resolved config.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from vlmrl.config import ConfigError, load_config


class _DropMessage(logging.Filter):
    """Drops one known-harmless message that an engine repeats on every request."""

    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_engine_noise() -> None:
    # In-process vLLM on CPU replaces torch.set_num_threads with a warning, and its multimodal input processing calls
    # it twice per request: ~9000 identical lines in a 150-step demo, burying the progress lines.
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropMessage("torch.set_num_threads"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    quiet_engine_noise()
    try:
        config = load_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from vlmrl.rollout.logs import log_engines_into
    from vlmrl.trainer.fit import fit  # torch, transformers and the engines load only for a valid config

    log_engines_into(config.trainer.output_dir)  # the engines' INFO chatter: OUTPUT_DIR/engine.log (docs/training.md)
    try:
        fit(config)
    except Exception as err:
        reported = reported_error(err)
        if reported is None:  # a bug: its traceback
            raise
        message, code = reported
        print(f"error: {message}", file=sys.stderr)
        return code
    return 0


def reported_error(error: BaseException) -> tuple[str, int] | None:
    """(the one line a user sees, the exit status) for a run's error the user can act on, None for the rest (they
    keep their traceback): bad data (the row, file and cause; 2), an engine vlmrl refused to start on these
    settings or this model (2), an engine the start-up check found computing another model than the trainer (1),
    and a rollout worker that died with no restart
    left (the worker and its pid, once: the rollout thread's and Ray's tracebacks around it say nothing more; 1)."""
    from vlmrl.data.dataset import DataError
    from vlmrl.processors.errors import BadRowError
    from vlmrl.rollout.errors import EngineSettingError, RestartsUsedUp
    from vlmrl.trainer.engine_probe import EngineModelError

    if isinstance(error, DataError) or (isinstance(error, BadRowError) and error.__cause__ is None):
        return str(error), 2  # a BadRowError with a cause is a bug in building a row
    # an engine refused before its start, or a server given by URL whose probes found it running otherwise: the
    # setting to change (ServerSettingError is an EngineSettingError)
    refused = _in_chain(error, EngineSettingError)
    if refused is not None:
        return str(refused), 2
    mismatch = _in_chain(error, EngineModelError)  # the start-up check: the engine computes another model
    if mismatch is not None:
        return str(mismatch), 1
    stopped = _in_chain(error, RestartsUsedUp)
    if stopped is not None:
        return str(stopped), 1
    return None


def _in_chain(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type `kind` in `error`'s chain of causes, None if there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def exit_without_native_teardown(code: int) -> None:
    """Exit as the interpreter would (non-daemon threads joined, atexit handlers run: Ray, multiprocessing, logging),
    then leave with os._exit, skipping interpreter finalization and C++ static destructors.

    Why: after a finished run native thread pools are still alive (pyarrow's CPU and IO pools from reading parquet,
    tokenizers' rayon pool, OpenBLAS servers, the engines' own threads). Tearing them down at exit races with their
    workers; under load it sometimes ends in std::terminate ("terminate called without an active exception", exit
    status 134) after `done: N steps` was printed (pyarrow's parquet threads do it elsewhere too: apache/arrow#34314).
    Everything vlmrl writes is closed and flushed by then, so there is nothing left for that teardown to do.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_native_teardown(main())
