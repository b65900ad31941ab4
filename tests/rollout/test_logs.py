"""Engine log routing: the engines' INFO chatter goes to OUTPUT_DIR/engine.log, warnings also to the console, and
VLMRL_ENGINE_LOG=console leaves the engines' logging alone. The loggers are the engines' names; no engine is started."""

from __future__ import annotations

import json
import logging
import os

import pytest

from vlmrl.rollout import logs


@pytest.fixture
def engine_logger(monkeypatch):
    """The `vllm` logger as vLLM sets it up (its own console handler, no propagation), put back afterwards."""
    logger = logging.getLogger("vllm")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    own = logging.StreamHandler()
    logger.handlers[:] = [own]
    logger.propagate, logger.level = False, logging.INFO
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLMRL_VLLM_LOGGING_CONFIG", raising=False)
    monkeypatch.delenv(logs.ENV, raising=False)
    monkeypatch.setattr(logs, "_folder", None)
    yield logger
    for handler in logger.handlers:
        handler.close()
    logger.handlers[:], logger.propagate, logger.level = saved


def test_info_goes_to_engine_log_and_warnings_to_the_console_too(engine_logger, tmp_path, capsys):
    logs.log_engines_into(tmp_path)
    path = logs.route_engine_logs("vllm")
    assert path == tmp_path / "engine.log"
    logging.getLogger("vllm.v1.worker").info("Reloading weights inplace...")
    logging.getLogger("vllm.config").warning("Enforce eager set")
    err = capsys.readouterr().err
    assert "Enforce eager set" in err and "Reloading weights" not in err
    text = path.read_text()
    assert "Reloading weights inplace" in text and "Enforce eager set" in text
    # the engine's child processes configure their logging from the same routing
    config = json.loads(open(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read())
    assert config["handlers"]["file"]["filename"] == str(path) and config["handlers"]["console"]["level"] == "WARNING"


def test_console_mode_and_a_backend_used_alone_leave_the_engine_logging_alone(engine_logger, tmp_path, monkeypatch):
    assert logs.route_engine_logs("vllm") is None  # no output folder named: a backend used on its own
    logs.log_engines_into(tmp_path)
    monkeypatch.setenv(logs.ENV, "console")
    assert logs.route_engine_logs("vllm") is None
    assert engine_logger.handlers and not (tmp_path / "engine.log").exists()
    monkeypatch.setenv(logs.ENV, "loud")
    with pytest.raises(ValueError, match="VLMRL_ENGINE_LOG='loud'"):
        logs.route_engine_logs("vllm")


def test_a_run_started_from_another_run_logs_into_its_own_folder(engine_logger, tmp_path, monkeypatch):
    """compare --backends, the tour test or a sweep script start vlmrl runs from a process that already routed its
    engine logs: the child inherits the variables, and must still write its own engine.log, not the parent's."""
    logs.log_engines_into(tmp_path / "parent")
    logs.route_engine_logs("vllm")
    monkeypatch.setattr(logs, "_ours", set())  # what a child process starts with; the environment is inherited
    logs.log_engines_into(tmp_path / "child")
    assert logs.route_engine_logs("vllm") == tmp_path / "child" / "engine.log"
    logging.getLogger("vllm.engine").info("child line")
    assert "child line" in (tmp_path / "child" / "engine.log").read_text()
    assert "child line" not in (tmp_path / "parent" / "engine.log").read_text()


def test_a_logging_config_of_the_users_own_is_respected(engine_logger, tmp_path, monkeypatch):
    logs.log_engines_into(tmp_path)
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "mine.json"))
    assert logs.route_engine_logs("vllm") is None
