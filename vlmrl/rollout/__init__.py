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

import importlib
from typing import Any

from vlmrl.rollout.base import (
    EngineDeadError,
    EngineTimeoutError,
    InvalidRequestError,
    RolloutBackend,
    RolloutError,
    RolloutOptions,
)

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


__all__ = [
    "BACKENDS",
    "EngineDeadError",
    "EngineTimeoutError",
    "InvalidRequestError",
    "RolloutBackend",
    "RolloutError",
    "RolloutOptions",
    "backend_class",
    "get_backend",
]
