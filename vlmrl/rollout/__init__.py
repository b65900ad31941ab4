"""Rollout backends behind one interface: `hf` (transformers reference), `vllm`, `sglang` (in-process Engine) and
`sglang-server` (HTTP, launched by vlmrl on 127.0.0.1 or given by URL).

    from vlmrl.rollout import get_backend
    with get_backend("vllm", "tiny", max_model_len=2048) as backend:
        results = backend.generate(requests, SamplingParams(n=8, temperature=1.0, max_new_tokens=256))
        backend.update_weights(actor.named_parameters())

Each engine is imported lazily, in exactly one module (`vlmrl.rollout.vllm`, `vlmrl.rollout.sglang`), only when
that backend is created. See `vlmrl.rollout.base` for the contract (request-major results, raw logprobs, banned pad
tokens, deadlines).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any

from vlmrl.rollout.base import (
    EngineDeadError,
    EngineTimeoutError,
    InvalidRequestError,
    RolloutBackend,
    RolloutError,
    RolloutOptions,
)

if TYPE_CHECKING:
    from vlmrl.config import RolloutConfig

logger = logging.getLogger(__name__)

# name -> (module, class); modules import their engine only inside the backend's methods.
BACKENDS: dict[str, tuple[str, str]] = {
    "hf": ("vlmrl.rollout.hf", "HFBackend"),
    "vllm": ("vlmrl.rollout.vllm", "VLLMBackend"),
    "sglang": ("vlmrl.rollout.sglang", "SGLangBackend"),
    "sglang-server": ("vlmrl.rollout.sglang", "SGLangServerBackend"),
}


def backend_class(name: str) -> type[RolloutBackend]:
    """The backend class for a name (imports its module, not its engine)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, model_path: str, **options: Any) -> RolloutBackend:
    """Start a rollout backend on a model folder (or an embedded name: `tiny`, `tiny-large`).

    Options are the fields of the backend's options class (`backend_class(name).options_class`): common ones are
    dtype, max_model_len, limit_images, timeout_s, start_timeout_s, seed, engine_kwargs; engines add their own
    (gpu_memory_utilization, tensor_parallel_size, ...; sglang-server: server_url, port, log_file).
    """
    from vlmrl.models import resolve_model_path

    cls = backend_class(name)
    return cls(resolve_model_path(model_path), cls.options_class.from_kwargs(name, options))


def backend_options(rollout: RolloutConfig, name: str, *, max_model_len: int, seed: int) -> dict[str, Any]:
    """`get_backend` options from a run's rollout section; engine-specific ones only where backend `name` takes them.

    max_model_len: the longest request, prompt + response (data.max_prompt_length + data.max_response_length).
    """
    options = {"dtype": rollout.dtype, "max_model_len": max_model_len, "limit_images": rollout.limit_images,
               "timeout_s": rollout.timeout_s, "start_timeout_s": rollout.start_timeout_s, "seed": seed,
               "engine_kwargs": dict(rollout.engine_kwargs)}
    accepted = {f.name for f in dataclasses.fields(backend_class(name).options_class)}
    extra = {"gpu_memory_utilization": rollout.gpu_memory_utilization,
             "tensor_parallel_size": rollout.tensor_parallel_size, "server_url": rollout.server_url or None}
    options.update({key: value for key, value in extra.items() if key in accepted and value is not None})
    return options


def start_backend(rollout: RolloutConfig, model_path: str, *, max_model_len: int, seed: int,
                  name: str | None = None) -> RolloutBackend:
    """Start the rollout section's backend (or `name`) on `model_path` (the actor's model, or a checkpoint)."""
    name = name or rollout.name
    logger.info("starting rollout backend %s on %s", name, model_path)
    return get_backend(name, model_path, **backend_options(rollout, name, max_model_len=max_model_len, seed=seed))


__all__ = [
    "BACKENDS",
    "EngineDeadError",
    "EngineTimeoutError",
    "InvalidRequestError",
    "RolloutBackend",
    "RolloutError",
    "RolloutOptions",
    "backend_class",
    "backend_options",
    "get_backend",
    "start_backend",
]
