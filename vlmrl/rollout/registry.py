"""The backend registry: a backend's class by name (its module imported, not its engine), and starting one from flat
keywords (`get_backend`) or from a run's rollout section (`start_backend`, `backend_options`).

    from vlmrl.rollout.registry import get_backend, start_backend
    with get_backend("vllm", "tiny", max_model_len=2048, enforce_eager=True) as backend:   # flat options
        results = backend.generate(requests, SamplingParams(n=8, temperature=1.0, max_new_tokens=256))
        backend.update_weights(actor.named_parameters())
    backend = start_backend(config.rollout, model_path, max_model_len=3072, seed=7)      # from a run's section
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from vlmrl.actor.config import LoraConfig
from vlmrl.rollout.config import ADAPTER_BACKENDS, BACKENDS, RolloutConfig

if TYPE_CHECKING:
    from vlmrl.rollout.base import BackendOptions, RolloutBackend

logger = logging.getLogger(__name__)


def backend_class(name: str) -> type[RolloutBackend]:
    """The backend class for a name (imports its module, not its engine)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, model_path: str, options: BackendOptions | None = None, **flat: Any) -> RolloutBackend:
    """Start a rollout backend on a model folder (or an embedded name: `tiny`, `tiny-large`), from `options` or
    from flat keywords: the rollout section's engine-neutral knobs (dtype, timeout_s, limit_images, ...), the
    fields of the backend's own sub-section(s) (vllm: enforce_eager, enable_sleep_mode, ...; sglang: max_total_tokens,
    attention_backend, ...; sglang-server: those and url, host, port, log_file; hf: device, engine_kwargs) and the
    derived max_model_len, seed, colocated, lora_rank, lora_vision. An unknown keyword raises naming every one the
    backend takes."""
    from vlmrl.models.tiny import resolve_model_path
    from vlmrl.rollout.base import BackendOptions

    cls = backend_class(name)
    if options is not None and flat:
        raise TypeError(f"{name}: give either options or keywords, not both")
    return cls(resolve_model_path(model_path), options or BackendOptions.from_kwargs(name, flat))


def backend_options(rollout: RolloutConfig, name: str, *, max_model_len: int, seed: int,
                    lora: LoraConfig | None = None, colocated: bool = False) -> BackendOptions:
    """What backend `name` starts from in a run: the rollout section as it is, the longest request (the run's
    `config.derived.max_model_len`), the seed (trainer.seed), whether it shares its device with the actor, and
    what a LoRA policy's adapter sync needs: vLLM started to serve adapters when actor.lora syncs them (sync adapter,
    or auto), with tower/connector LoRA for lora.vision; nothing otherwise."""
    from vlmrl.rollout.base import BackendOptions

    serves = lora is not None and lora.may_sync_adapter and name in ADAPTER_BACKENDS
    return BackendOptions(rollout=rollout, max_model_len=max_model_len, seed=seed, colocated=colocated,
                          lora_rank=lora.rank if serves else 0, lora_vision=serves and lora.vision != "off")


def start_backend(rollout: RolloutConfig, model_path: str, *, max_model_len: int, seed: int,
                  name: str | None = None, lora: LoraConfig | None = None, colocated: bool = False
                  ) -> RolloutBackend:
    """Start the run's rollout backend (rollout.name, or `name`) on `model_path` (the actor's model or a checkpoint);
    `lora`: the actor's LoRA settings (the engine then serves adapters where they sync as such); `colocated`: it
    shares its device with the training actor."""
    name = name or rollout.name
    logger.info("starting rollout backend %s on %s", name, model_path)
    return get_backend(name, model_path, backend_options(rollout, name, max_model_len=max_model_len, seed=seed,
                                                         lora=lora, colocated=colocated))


def cpu_env(rollout: RolloutConfig, name: str | None = None) -> dict[str, str]:
    """The environment backend `name` (rollout.name) sets for itself on a CPU (each engine's `cpu_env`), for a
    process that will start it; empty on a machine with a GPU. A variable already set here is left out: an explicit
    value wins."""
    import torch

    name = name or rollout.name
    if torch.cuda.is_available():
        return {}
    if name == "vllm":
        from vlmrl.rollout.vllm_cpu import cpu_env as vllm_cpu_env

        return vllm_cpu_env(rollout.vllm)
    if name in ("sglang", "sglang-server"):
        from vlmrl.rollout.sglang import cpu_env as sglang_cpu_env

        return sglang_cpu_env()
    return {}
