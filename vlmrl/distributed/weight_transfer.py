"""How a weight sync reaches rollout workers (trainer.async_rollout.weight_transfer): through a collective group
from the trainer's process straight into every engine rank, or through Ray's object store.

    collective:    trainer (rank 0) --broadcast, a bucket at a time--> every TP rank of every worker's engine
    object_store:  trainer --ray.put(bucket) once--> the object store --ray.get--> every worker --> its engine

- **collective** (slime's, AReaL's and verl's layout: the engines' own weight-update APIs over a NCCL group; gloo
  on CPU): the sender joins the group as rank 0 (`vlmrl.rollout.weight_group`) and broadcasts each bucket of the
  sync plan once; every engine rank receives it while its worker's `receive_bucket` call runs. The sender is the
  driver at dp = 1 (`CollectiveSender.send`), and training rank 0 at dp > 1 (`WeightSource`,
  `CollectiveSender.send_from_source`): every rank gathers the weights from its shards while rank 0 cuts and
  broadcasts them, and only each bucket's meta passes through the driver. Nothing is stored: the sender holds one
  bucket at a time and the object store nothing.
- **object_store** (the fallback): each bucket put once into Ray's object store and read by every worker; the last
  sync stays stored until the next one, so a restarted worker reloads it from there.
- **auto** takes the group where every worker's engine receives over the device's transport (gloo on CPU, NCCL on
  GPU: vLLM and SGLang do; hf and a launched sglang-server do not), the object store otherwise.

A sync carries a version (the number of syncs so far); every worker reports the version its engine holds after it,
and a sync that leaves any worker short of it is an error, never an engine on mixed weights.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vlmrl.rollout.weight_group import WeightGroup, free_port, join_group, leave_group, pack_bucket, send_bucket
from vlmrl.rollout.weights import SyncRecipe

logger = logging.getLogger(__name__)

TRANSFERS = ("auto", "collective", "object_store")


@dataclass
class GroupMember:
    """One worker in the group: its Ray handle and its first rank (each of its engine's TP ranks follows)."""

    worker: Any
    rank_offset: int


class WeightSource(Protocol):
    """The training ranks as the group's sender (`vlmrl.distributed.group.DistributedActor` at dp > 1): training
    rank 0 joins as the group's rank 0 and broadcasts each bucket as the ranks gather it, so the full weights pass
    through no other process (slime's layout). Each method returns Ray references; the sender waits on them."""

    def weight_group_address(self, port: int) -> Any:
        """A reference to (training rank 0's node address, `port` or a port free there)."""

    def join_weight_group(self, group: WeightGroup) -> Any:
        """A reference that resolves once training rank 0 has joined `group` as its rank 0."""

    def leave_weight_group(self) -> Any:
        """A reference that resolves once training rank 0 has left its group."""

    def send_weights(self, recipe: SyncRecipe) -> tuple[Any, list[Any]]:
        """(training rank 0's stream of each bucket's `BucketMeta`, yielded before the bucket's broadcast; the other
        ranks' references, resolved once they have gathered every tensor)."""


class CollectiveSender:
    """Rank 0 of a weight group over rollout workers: forms the group (`form`), sends a sync (`send` from this
    process, `send_from_source` from the training ranks), leaves it (`close`). `call(refs, index, what)` is the
    caller's ray.get with its deadline and dead-worker errors. `source`: the training ranks that send (at dp > 1);
    None: this process sends."""

    def __init__(self, backend: str, address: str, port: int, timeout_s: float,
                 call: Callable[[Any, int, str], Any], source: WeightSource | None = None):
        self.backend = backend
        self.address = address
        self.port = port
        """0: a free port picked for each group formed."""
        self.timeout_s = timeout_s
        self.call = call
        self.source = source
        self.group: WeightGroup | None = None
        self.pg = None
        self.members: list[GroupMember] = []

    def form(self, workers: list[Any], tp_sizes: list[int]) -> None:
        """A new group over `workers` (each with its engine's TP size): the sender joins as rank 0 while every
        worker's engine joins at its offset. Raises RuntimeError naming the group when the rendezvous fails (the
        port is taken, a rank never comes within the deadline)."""
        self.close()
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(workers))]
        if self.source is None:
            address, port = listen_address(self.address, self.port)
        else:  # rank 0 listens on training rank 0's node, which checks the port there
            address, port = self._from_source(self.source.weight_group_address(self.port), "its address")
        self.group = WeightGroup(address=address, port=port, world_size=1 + sum(tp_sizes),
                                 name=f"vlmrl-weights-{uuid.uuid4().hex[:8]}", backend=self.backend,
                                 timeout_s=self.timeout_s)
        self.members = [GroupMember(w, o) for w, o in zip(workers, offsets)]
        refs = [m.worker.join_weight_group.remote(self.group, m.rank_offset) for m in self.members]
        try:
            if self.source is None:
                self.pg = join_group(self.group, 0)
            else:
                self._from_source(self.source.join_weight_group(self.group), f"joining {self.group.name}")
        except RuntimeError:
            for ref in refs:  # the engines' side of the same failure, if they said more
                _cancel(ref)
            raise
        for index, ref in enumerate(refs):
            self.call(ref, index, f"joining weight group {self.group.name}")
        logger.info("weight group %s: %d ranks (%s) at %s:%d, sent from %s", self.group.name, self.group.world_size,
                    self.backend, address, port, "this process" if self.source is None else "training rank 0")

    def send(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> int:
        """Broadcast the buckets from this process into every member's engine (begin, a receive per bucket, end at
        `version`); returns the bytes broadcast. Any failure raises: the caller restarts or stops."""
        if self.pg is None or self.source is not None:
            raise RuntimeError("the weight group is not formed" if self.source is None else
                               "the weight group's sender is training rank 0: send_from_source")
        self._on_all(lambda m: m.worker.begin_receive.remote(), "opening the weight load")
        sent = 0
        for bucket in buckets:
            meta, flat = pack_bucket(bucket)
            del bucket
            refs = [m.worker.receive_bucket.remote(meta) for m in self.members]
            error: list[BaseException] = []
            # the broadcast blocks until every rank took the bucket: beside it, the workers' answers are awaited, so
            # a worker that dies shows as its Ray error rather than as the group's timeout alone
            thread = threading.Thread(target=_broadcast, args=(flat, self.pg, self.backend, error), daemon=True)
            thread.start()
            for index, ref in enumerate(refs):
                self.call(ref, index, "receiving weights")
            thread.join(self.timeout_s)
            if thread.is_alive() or error:
                raise RuntimeError(f"weight group {self.group.name}: the broadcast of a bucket failed: "
                                   f"{error[0] if error else 'no answer within the deadline'}")
            sent += flat.numel()
        self._on_all(lambda m: m.worker.end_receive.remote(version), "closing the weight load")
        return sent

    def send_from_source(self, recipe: SyncRecipe, version: int) -> tuple[int, int]:
        """The sync sent by the training ranks (`WeightSource.send_weights`), cut by `recipe` as the backend cuts
        its syncs: each bucket's meta comes from training rank 0 before its broadcast, and every member receives
        it; returns (the bytes broadcast, the tensors). Any failure raises: the caller restarts or stops."""
        if self.pg is not None or self.source is None or self.group is None:
            raise RuntimeError("the weight group is not formed with the training ranks as its sender")
        import ray

        self._on_all(lambda m: m.worker.begin_receive.remote(), "opening the weight load")
        metas, others = self.source.send_weights(recipe)
        sent = tensors = 0
        while True:
            ready, _ = ray.wait([metas], timeout=self.timeout_s)
            if not ready:
                raise RuntimeError(f"weight group {self.group.name}: training rank 0 sent no bucket within "
                                   f"{self.timeout_s:.0f} s")
            try:
                ref = next(metas)
            except StopIteration:
                break
            meta = self._from_source(ref, "sending a bucket")
            refs = [m.worker.receive_bucket.remote(meta) for m in self.members]
            for index, ref in enumerate(refs):
                self.call(ref, index, "receiving weights")
            sent, tensors = sent + meta.nbytes, tensors + len(meta.names)
        self._from_source(others, "gathering the weights")
        self._on_all(lambda m: m.worker.end_receive.remote(version), "closing the weight load")
        return sent, tensors

    def _from_source(self, refs, what: str):
        """ray.get of the training ranks' references within the group's deadline; their failure as RuntimeError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except RayTaskError as err:
            raise RuntimeError(f"weight group: training rank 0, {what}: {err.cause}") from None
        except GetTimeoutError:
            raise RuntimeError(f"weight group: training rank 0, {what}: no answer within {self.timeout_s:.0f} s"
                               ) from None
        except RayActorError as err:
            raise RuntimeError(f"weight group: training rank 0, {what}: a training worker died "
                               f"({type(err).__name__})") from err

    def _on_all(self, make: Callable[[GroupMember], Any], what: str) -> list[Any]:
        refs = [make(m) for m in self.members]
        return [self.call(ref, index, what) for index, ref in enumerate(refs)]

    def close(self) -> None:
        """Leave the group (the workers leave theirs when they form a new one or end)."""
        if self.source is not None and self.group is not None:
            try:
                self._from_source(self.source.leave_weight_group(), "leaving the group")
            except RuntimeError as err:  # a rank that died has no group left to leave
                logger.warning("%s", err)
        leave_group(self.pg)
        self.pg, self.group, self.members = None, None, []


def listen_address(address: str, port: int) -> tuple[str, int]:
    """(address, port) where a weight group's rank 0 listens: `port` once it is checked free at `address` (a taken
    port would leave the engines waiting on another process's socket to the deadline), or a free one for 0."""
    if port:
        port_is_free(address, port)
    return address, port or free_port(address)


def port_is_free(address: str, port: int) -> None:
    """Raise RuntimeError naming the port when this process cannot listen on it at `address`."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError as err:
            raise RuntimeError(f"the weight group's port {address}:{port} is taken ({err.strerror})") from None


def _broadcast(flat: torch.Tensor, pg, backend: str, error: list[BaseException]) -> None:
    try:
        send_bucket(pg, flat, backend)
    except BaseException as err:  # noqa: BLE001 - handed to the sending thread
        error.append(err)


def _cancel(ref) -> None:
    import ray

    try:
        ray.cancel(ref, force=False)
    except Exception:  # noqa: BLE001 - nothing to cancel
        pass


def resolve_transfer(setting: str, backend: str, engines_take: list[tuple[str, ...]], engine: str) -> str:
    """`collective` or `object_store` for trainer.async_rollout.weight_transfer=`setting`, given the transports each
    worker's engine receives over (`RolloutBackend.weight_group_backends`) and the group's `backend`. Raises
    ValueError when `collective` is asked of an engine that cannot join.

    >>> resolve_transfer("auto", "gloo", [("gloo", "nccl")], "vllm"), resolve_transfer("auto", "gloo", [()], "hf")
    ('collective', 'object_store')
    """
    if setting not in TRANSFERS:
        raise ValueError(f"trainer.async_rollout.weight_transfer={setting!r}: choose one of {TRANSFERS}")
    joins = all(backend in takes for takes in engines_take)
    if setting == "collective" and not joins:
        raise ValueError(f"trainer.async_rollout.weight_transfer=collective: rollout.name={engine} receives no "
                         f"weights over a {backend} group (vllm and sglang do); use object_store or auto")
    return "collective" if setting == "collective" or (setting == "auto" and joins) else "object_store"
