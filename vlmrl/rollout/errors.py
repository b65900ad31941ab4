"""The errors every backend raises: a bad request before the engine, a failed, dead or hung engine after."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """An engine call failed; the message starts with the backend's name."""


class EngineDeadError(RolloutError):
    """The engine (or server) process is gone; the backend cannot be used again: close it and start a new one."""


class EngineTimeoutError(RolloutError):
    """An engine call ran past its deadline; the backend is considered broken from then on."""


class InvalidRequestError(ValueError):
    """A request that no engine may receive (placeholder/image mismatch, overlong, bad sampling settings).
    Raised before anything reaches the engine; the message names the request."""
