"""vLLM on a CPU: the environment its engine needs, and unique names for the shared memory of its tensor-parallel
ranks. Imports nothing of vLLM at module level (the registry reads `cpu_env` for processes it has not started)."""

from __future__ import annotations

import os

from vlmrl.rollout.config import VLLMConfig

SHM_NAME_ENV = "VLMRL_VLLM_SHM_NAME"
"""The name an spmd engine's CPU TP shared memory starts with (set by the training worker, the same on the group's
ranks). vLLM 0.32 names those segments from its distributed init method, which its external launcher fixes to
`env://`: every TP group on a machine would create /dev/shm/-tp:0-[0-1]-cpushm_0, so a second engine (or one after
a killed run, which leaves them behind) fails at start ("create shm in SHMManager failed. errno: 17")."""


def name_cpu_shared_memory() -> None:
    """Prefix vLLM's CPU TP shared-memory names with $VLMRL_VLLM_SHM_NAME (a patch of
    `_CPUSHMDistributed.make_group_name`, applied once per process; a no-op without the variable)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "vlmrl", False):
        return
    original = shm.make_group_name

    def make_group_name(communicator) -> str:
        name = original(communicator)
        prefix = os.environ.get(SHM_NAME_ENV, "")
        return f"{prefix}{name.lstrip('/')}" if prefix else name

    make_group_name.vlmrl = True
    shm.make_group_name = staticmethod(make_group_name)


def cpu_env(section: VLLMConfig) -> dict[str, str]:
    """What vLLM needs on a CPU: the engine core in-process (unless rollout.vllm.multiprocess says: a ~3 s start, and
    no engine process beside the trainer's on a few cores) and a KV cache of cpu_kv_cache_gb (else start-up fails).
    A variable the environment already sets is left out: an explicit value wins."""
    wanted = {"VLLM_CPU_KVCACHE_SPACE": f"{section.cpu_kv_cache_gb:g}"}
    if section.multiprocess is None:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {key: value for key, value in wanted.items() if key not in os.environ}
