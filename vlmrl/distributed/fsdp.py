"""FSDP2 for the actor and the reference: process group, sharding, full weights, sharded gradient clipping.

Everything here runs inside one training worker (one process per device) after `init_process_group`; with
`world_size == 1` nothing is sharded and the same functions work on a plain module, so the single-process path and
the distributed path call the same code.

Collectives (all-gathers in the forward, reduce-scatters in the backward, the full-weights gather) must be issued by
every rank in the same order with the same sizes: a rank that skips one hangs or aborts the group. The process group
therefore always gets a finite timeout, so a mistake ends the run with an error instead of a silent hang.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


def default_backend(device: torch.device) -> str:
    """nccl on CUDA devices, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device, timeout_s: float
) -> None:
    """Join this process to the training group (TCP rendezvous at rank 0's address). No-op for world_size 1.

    Every rank must call this at about the same time: it blocks until all `world_size` ranks have joined.
    """
    if world_size == 1 or dist.is_initialized():
        return
    backend = default_backend(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    logger.info("rank %d/%d joined the %s process group at %s:%d", rank, world_size, backend, master_addr, master_port)


def world() -> tuple[int, int]:
    """(rank, world_size) of this process; (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: every module whose class is in the HF model's
    `_no_split_modules` (for Qwen2.5-VL: the decoder layers and the vision tower's blocks).

    Each becomes one FSDP unit (its parameters gathered just before it runs and freed after), so peak memory holds
    one block's full weights rather than the model's. Everything else (embeddings, lm_head, norms, the vision
    patch embedding and merger) stays in the root unit.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"found no blocks to shard in {type(model).__name__} (no `_no_split_modules` classes)")
    return blocks


def shard_model(model: nn.Module, world_size: int, offload: bool = False) -> nn.Module:
    """Apply FSDP2 (`fully_shard`) to every block and then the root; returns the same module, now sharded in place.

    world_size 1 returns the module untouched (the single-process path needs no collectives). `offload`: the shards
    (and their gradients) live in host memory (CPUOffloadPolicy), copied to the device block by block.
    The vision blocks are sharded too: that is safe only because every rank runs the vision tower in every forward
    (see `vlmrl.distributed.vision.VisionAlwaysOn`).
    """
    if world_size == 1:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # pinned host memory makes the copies asynchronous; it needs CUDA
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    blocks = shardable_blocks(model)
    for block in blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    logger.info("FSDP2: sharded %d blocks + the root over %d ranks%s", len(blocks), world_size,
                ", parameters offloaded to the CPU" if offload else "")
    return model



def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor from a sharded (DTensor) one: an all-gather every rank must join. Plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def iter_full_state_dict(model: nn.Module, prefix_to_strip: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full detached tensor) for every parameter and buffer, one at a time.

    A collective on every rank (each sharded tensor is all-gathered): all ranks must consume the whole iterator in
    the same order, even ranks that drop the tensors. One tensor is materialised at a time, so peak memory grows by
    the largest tensor, not the model.

    Args:
        model: the (possibly sharded) module.
        prefix_to_strip: removed from the front of each name (a wrapper's attribute, e.g. "model.").
    """
    for name, tensor in model.state_dict().items():
        if prefix_to_strip and name.startswith(prefix_to_strip):
            name = name[len(prefix_to_strip):]
        yield name, full_tensor(tensor.detach())


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Clip the GLOBAL gradient norm (over every shard of every rank) to max_norm; returns the norm before clipping.

    With sharded (DTensor) gradients torch's clip_grad_norm_ computes the norm over the whole parameter (it reduces
    across ranks), so every rank scales by the same factor and the result equals the single-process clip.
    max_norm <= 0 only measures the norm.
    """
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(grads, limit)
    return float(full_tensor(norm))
