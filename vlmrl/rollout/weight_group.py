"""Weights sent to engines through a collective group: the group's description, how a process joins it, and the
layout of one bucket on the wire. Engine-neutral: the trainer side (`vlmrl.distributed.weight_transfer`) and each
engine's receiving side (SGLang's own `init_weights_update_group` / `update_weights_from_distributed`, vLLM's worker
extension) read the same layout.

    rank 0 (the trainer's process)  --broadcast(one flat bucket)-->  ranks 1..N (every TP rank of every engine)

- **The group** is SGLang's "weight update group" (`init_custom_process_group`, after OpenRLHF's): a torch process
  group of its own, outside any default group, rendezvoused over TCP at rank 0's address. Rank 0 is the sender;
  each engine joins at a rank offset plus its TP rank. gloo on CPU, NCCL on GPU.
- **A bucket** (rollout.sync_bucket_mb of the engine's dtype) travels as one uint8 tensor: its tensors' bytes one
  after another, in the order of `BucketMeta.names`, which is SGLang's `FlattenedTensorBucket` layout (its
  `load_format="flattened_bucket"`), so that one broadcast carries a bucket. Tensors are ordered by element size,
  largest first, so that each starts at a multiple of its own (the receiver checks the alignment).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightGroup:
    """A collective weight group: where rank 0 listens, how many ranks join it, its name and its transport."""

    address: str
    """Rank 0's host, reachable from every engine's node (the driver's node IP on a cluster)."""
    port: int
    world_size: int
    """1 (the sender) + every engine's TP ranks."""
    name: str
    backend: str = "gloo"
    """gloo (CPU engines) or nccl (GPU engines)."""
    timeout_s: float = 300.0
    """Deadline of the rendezvous and of every broadcast on the group (rollout.timeout_s)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight group backend {self.backend!r}: choose one of {BACKENDS}")
        if self.world_size < 2:
            raise ValueError(f"a weight group needs the sender and at least one engine rank, got {self.world_size}")


@dataclass(frozen=True)
class BucketMeta:
    """What a receiver allocates for one bucket before the broadcast: its tensors' names, dtypes and shapes."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    """torch dtype names (`float32`, `bfloat16`), as SGLang's update_weights_from_distributed takes them."""
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(_numel(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(self.dtypes, self.shapes))


def join_group(group: WeightGroup, rank: int) -> torch.distributed.ProcessGroup:
    """Join `group` as `rank` (0: the sender, which hosts the rendezvous) and return the process group. The same
    construction as SGLang's `init_custom_process_group`, which its engines run on their side: torch's TCP
    rendezvous, a store prefixed with the group's name, a process group outside the default one. Raises
    RuntimeError (the rendezvous timed out, the port is taken) naming the group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=group.timeout_s)
    try:
        store, rank, world = next(rendezvous(f"tcp://{group.address}:{group.port}", rank, group.world_size,
                                             timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(world, rank, [], Backend(group.backend), PrefixStore(group.name, store),
                                          group_name=group.name, timeout=timeout)
    except (RuntimeError, OSError) as err:
        raise RuntimeError(f"weight group {group.name} at {group.address}:{group.port} ({group.world_size} ranks, "
                           f"{group.backend}): rank {rank} could not join: {err}") from err
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def leave_group(pg: torch.distributed.ProcessGroup | None) -> None:
    """Destroy a joined group (a no-op for None or one already gone)."""
    if pg is None:
        return
    try:
        torch.distributed.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError):
        pass


def pack_bucket(bucket: dict[str, torch.Tensor]) -> tuple[BucketMeta, torch.Tensor]:
    """(its meta, one flat uint8 tensor) of a bucket of contiguous CPU tensors, in `FlattenedTensorBucket`'s layout,
    largest elements first.

    >>> meta, flat = pack_bucket({"b": torch.ones(3, dtype=torch.bfloat16), "a": torch.zeros(2, 2)})
    >>> meta.names, meta.dtypes, meta.shapes, flat.numel()
    (('a', 'b'), ('float32', 'bfloat16'), ((2, 2), (3,)), 22)
    """
    items = sorted(bucket.items(), key=lambda item: -item[1].element_size())
    meta = BucketMeta(names=tuple(name for name, _ in items),
                      dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in items),
                      shapes=tuple(tuple(t.shape) for _, t in items))
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]) if items else \
        torch.empty(0, dtype=torch.uint8)
    return meta, flat


def unpack_bucket(meta: BucketMeta, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a received flat bucket (views into `flat`).

    >>> meta, flat = pack_bucket({"w": torch.arange(6.0).reshape(2, 3)})
    >>> [(name, t.tolist()) for name, t in unpack_bucket(meta, flat)]
    [('w', [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])]
    """
    if flat.numel() != meta.nbytes:
        raise ValueError(f"a weight bucket of {flat.numel()} bytes for tensors of {meta.nbytes}")
    out, offset = [], 0
    for name, dtype, shape in zip(meta.names, meta.dtypes, meta.shapes):
        dtype = getattr(torch, dtype)
        size = _numel(shape) * dtype.itemsize
        out.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
        offset += size
    return out


def send_bucket(pg: torch.distributed.ProcessGroup, flat: torch.Tensor, backend: str) -> None:
    """One packed bucket broadcast from rank 0 of `pg` (the sender's side): on the GPU for NCCL, which moves only
    device tensors."""
    torch.distributed.broadcast(flat.cuda() if backend == "nccl" else flat, src=0, group=pg)


def receive_bucket(pg: torch.distributed.ProcessGroup, meta: BucketMeta, device: str | torch.device = "cpu"
                   ) -> list[tuple[str, torch.Tensor]]:
    """One bucket broadcast from rank 0 of `pg`, unpacked (a receiving engine rank's side)."""
    flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    torch.distributed.broadcast(flat, src=0, group=pg)
    return unpack_bucket(meta, flat)


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n
