"""A backend's start-up options from the run's rollout section (what `get_backend(name, path, **options)` takes)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vlmrl.rollout import backend_class

if TYPE_CHECKING:
    from vlmrl.config import RolloutConfig


def backend_options(rollout: RolloutConfig, name: str, max_model_len: int, seed: int) -> dict[str, Any]:
    """get_backend options for backend `name`; engine-specific ones only where the backend takes them.

    Args:
        rollout: the run's rollout section.
        name: the backend (hf, vllm, sglang, sglang-server).
        max_model_len: prompt + response tokens (data.max_prompt_length + data.max_response_length).
        seed: the engine's sampling seed (trainer.seed).
    """
    options = {"dtype": rollout.dtype, "max_model_len": max_model_len, "limit_images": rollout.limit_images,
               "timeout_s": rollout.timeout_s, "start_timeout_s": rollout.start_timeout_s, "seed": seed,
               "engine_kwargs": dict(rollout.engine_kwargs)}
    accepted = {f.name for f in dataclasses.fields(backend_class(name).options_class)}
    extra = {"gpu_memory_utilization": rollout.gpu_memory_utilization,
             "tensor_parallel_size": rollout.tensor_parallel_size, "server_url": rollout.server_url or None}
    options.update({key: value for key, value in extra.items() if key in accepted and value is not None})
    return options
