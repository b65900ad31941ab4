"""Rollout backends behind one interface: `hf` (transformers reference), `vllm`, `sglang` (in-process Engine) and
`sglang-server` (HTTP, launched by vlmrl on 127.0.0.1 or given by URL).

    from vlmrl.rollout import get_backend, start_backend
    with get_backend("vllm", "tiny", max_model_len=2048) as backend:
        results = backend.generate(requests, SamplingParams(n=8, temperature=1.0, max_new_tokens=256))
        backend.update_weights(actor.named_parameters())
    backend = start_backend(config.rollout, model_path, max_model_len=3072, seed=config.trainer.seed)  # for a run

Each engine is imported lazily, in exactly one module (`vlmrl.rollout.vllm`, `vlmrl.rollout.sglang`), only when
that backend is created; this package imports torch only when a backend or `vlmrl.rollout.base` is asked for (the
run config imports `vlmrl.rollout.config`). See `vlmrl.rollout.base` for the contract (request-major results, raw
logprobs, banned pad tokens, deadlines).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any

from vlmrl.actor.config import LoraConfig
from vlmrl.rollout.config import BACKENDS, RolloutConfig, lora_engine_options
from vlmrl.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from vlmrl.rollout.base import RolloutBackend

logger = logging.getLogger(__name__)

_FROM_BASE = ("EngineDeadError", "EngineTimeoutError", "InvalidRequestError", "RolloutBackend", "RolloutError",
              "RolloutOptions")


__getattr__ = lazy_exports(__name__, dict.fromkeys(_FROM_BASE, "base"))


def backend_class(name: str) -> type[RolloutBackend]:
    """The backend class for a name (imports its module, not its engine)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, model_path: str, **options: Any) -> RolloutBackend:
    """Start a rollout backend on a model folder (or an embedded name: `tiny`, `tiny-large`).

    Options are the fields of the backend's options class (`backend_class(name).options_class`): every backend takes
    dtype, max_model_len, limit_images, timeout_s, start_timeout_s, seed, engine_kwargs; vllm and sglang add
    gpu_memory_utilization, tensor_parallel_size and their own (enforce_eager, attention_backend, ...); sglang-server
    also server_url, port, log_file.
    """
    from vlmrl.models import resolve_model_path

    cls = backend_class(name)
    return cls(resolve_model_path(model_path), cls.options_class.from_kwargs(name, options))


def backend_options(rollout: RolloutConfig, name: str, *, max_model_len: int, seed: int,
                    lora: LoraConfig | None = None) -> dict[str, Any]:
    """get_backend options of a run for backend `name`: the rollout section's engine options that this backend takes
    (each declared once, in the class of the backends that take it: vlmrl.rollout.config), the longest request
    (data.max_prompt_length + data.max_response_length), the seed (trainer.seed) and what a LoRA policy's adapter
    sync needs (`lora_engine_options`)."""
    accepted = {f.name for f in dataclasses.fields(backend_class(name).options_class)}
    options = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.name in accepted}
    options["engine_kwargs"] = dict(rollout.engine_kwargs)
    extra = lora_engine_options(lora, name) if lora is not None else {}
    return {**options, "max_model_len": max_model_len, "seed": seed, **extra}


def start_backend(rollout: RolloutConfig, model_path: str, *, max_model_len: int, seed: int,
                  name: str | None = None, lora: LoraConfig | None = None) -> RolloutBackend:
    """Start the run's rollout backend (rollout.name, or `name`) on `model_path` (the actor's model or a checkpoint);
    `lora`: the actor's LoRA settings (the engine then serves adapters where they sync as such)."""
    name = name or rollout.name
    logger.info("starting rollout backend %s on %s", name, model_path)
    return get_backend(name, model_path, **backend_options(rollout, name, max_model_len=max_model_len, seed=seed,
                                                           lora=lora))


__all__ = [
    "BACKENDS",
    "EngineDeadError",
    "EngineTimeoutError",
    "InvalidRequestError",
    "RolloutBackend",
    "RolloutConfig",
    "RolloutError",
    "RolloutOptions",
    "backend_class",
    "backend_options",
    "get_backend",
    "start_backend",
]
