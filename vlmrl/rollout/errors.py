"""The errors every backend raises: a bad request before the engine, a failed, dead or hung engine after."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """An engine call failed; the message starts with the backend's name."""


class EngineDeadError(RolloutError):
    """The engine (or server) process is gone; the backend cannot be used again: close it and start a new one."""


class RestartsUsedUp(EngineDeadError):
    """A rollout worker died and trainer.async_rollout.worker_restarts are used up: the run stops (the message names
    the worker and its pid). The command line reports it as one `error:` line."""


class EngineTimeoutError(RolloutError):
    """An engine call ran past its deadline; the backend is considered broken from then on."""


class EngineSettingError(ValueError):
    """vlmrl refuses to start an engine with these settings on this model (the message names the setting or the
    model's problem and what to change). Raised before the engine starts; the command line reports it as one
    `error:` line."""


class ServerSettingError(EngineSettingError, RolloutError):
    """A server vlmrl connects to (given by URL) runs with settings vlmrl cannot train on, found by its start-up
    probes (the message names the setting and how to restart the server). The command line reports it as one
    `error:` line, like an engine refused before its start."""


class InvalidRequestError(ValueError):
    """A request that no engine may receive (placeholder/image mismatch, overlong, bad sampling settings).
    Raised before anything reaches the engine; the message names the request."""
