"""Where the engines' own log lines go: vLLM's and SGLang's INFO chatter (SGLang's server_args dump at start-up,
vLLM's engine config and its lines on every weight sync) into OUTPUT_DIR/engine.log, so that vlmrl's progress and
step lines stay readable; the engines' warnings and errors still reach the console (and the file).

`VLMRL_ENGINE_LOG=console` leaves the engines' logging as they set it up themselves (all of it on the console).
A backend calls `route_engine_logs` just before it imports and starts its engine; the trainer names the folder once
(`log_engines_into`). Nothing is routed while no folder is named (a backend used on its own, in a notebook or a test),
nor for an engine whose logging the user configured (VLLM_LOGGING_CONFIG_PATH / SGLANG_LOGGING_CONFIG_PATH set).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

ENV = "VLMRL_ENGINE_LOG"
"""`console`: the engines log to the console as they do by themselves; unset (or `file`): into OUTPUT_DIR/engine.log."""
FILE_NAME = "engine.log"
_CONFIG_ENV = {"vllm": "VLLM_LOGGING_CONFIG_PATH", "sglang": "SGLANG_LOGGING_CONFIG_PATH"}
"""Each engine's own switch for a logging.config.dictConfig JSON file, read by its child processes too."""
_OWNED_ENV = {"vllm": "VLMRL_VLLM_LOGGING_CONFIG", "sglang": "VLMRL_SGLANG_LOGGING_CONFIG"}
"""The config file vlmrl itself put in the engine's variable. Child processes inherit both variables, so a vlmrl run
started from another (compare --backends, a test, a sweep script) can tell vlmrl's file from one the user set."""
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_folder: Path | None = None
_ours: set[str] = set()  # config files written here (a user's own file is left alone)


def log_engines_into(folder: str | os.PathLike) -> None:
    """Engines started from now on log into `folder`/engine.log (the run's output folder)."""
    global _folder
    _folder = Path(folder)


def engine_log_path() -> Path | None:
    """The engine log file, or None when the engines log to the console."""
    mode = os.environ.get(ENV, "file").strip().lower()
    if mode not in ("file", "console", ""):
        raise ValueError(f"{ENV}={mode!r}: use `console` (engine logs on the console) or leave it unset "
                         f"(engine logs in OUTPUT_DIR/{FILE_NAME})")
    return None if mode == "console" or _folder is None else _folder / FILE_NAME


def route_engine_logs(engine: str, level: str = "INFO") -> Path | None:
    """Send logger `engine` (`vllm` or `sglang`) from `level` up to engine.log, warnings and errors also to stderr,
    in this process and (through the engine's config-file variable) in the engine's child processes. Returns the
    file, or None when nothing was routed."""
    path = engine_log_path()
    variable = _CONFIG_ENV[engine]
    current = os.environ.get(variable)
    if path is None or (current and current not in _ours and current != os.environ.get(_OWNED_ENV[engine])):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    config_file = path.with_name(f".{engine}-logging.json")
    level = level.upper()
    config_file.write_text(json.dumps(_dict_config(engine, path, level), indent=1))
    os.environ[variable] = os.environ[_OWNED_ENV[engine]] = str(config_file)
    _ours.add(str(config_file))
    logger = logging.getLogger(engine)
    for handler in list(logger.handlers):  # the engine's own console handler (vLLM prints INFO to stdout)
        logger.removeHandler(handler)
    file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    for handler in (file_handler, console):
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False  # vlmrl's own console handler (on the root logger) would print the INFO lines again
    logger.setLevel(level)
    return path


def _dict_config(engine: str, path: Path, level: str) -> dict:
    """The same routing for the engine's child processes, which configure their logging from this file."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT, "datefmt": "%H:%M:%S"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(path), "mode": "a", "formatter": "plain"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "WARNING",
                        "formatter": "plain"},
        },
        "loggers": {engine: {"handlers": ["file", "console"], "level": level, "propagate": False}},
    }
