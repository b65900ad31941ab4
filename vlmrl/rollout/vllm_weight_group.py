"""vLLM's side of a collective weight group (`vlmrl.rollout.weight_group`): each of the engine's TP workers joins the
group at the backend's rank offset plus its TP rank (`WeightGroupExtension`, mixed into vLLM's worker with the
weight-sync extension), and receives each bucket from the sender's broadcast into vLLM's own layer-wise reload, as a
bucket pushed through `update_weights` is loaded (begin, a load per bucket, finish). Imports vLLM only inside the
worker and the backend's calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.weight_group import BucketMeta, WeightGroup, join_group, leave_group, receive_bucket


class WeightGroupExtension:
    """Mixed into vLLM's worker class; `self` is the worker (one per TP rank)."""

    def vlmrl_join_weight_group(self, group: dict[str, Any], rank_offset: int) -> int:
        """Join the group as rank_offset + this worker's TP rank; returns that rank."""
        from vllm.distributed import get_tensor_model_parallel_rank

        self.vlmrl_leave_weight_group()
        rank = rank_offset + get_tensor_model_parallel_rank()
        self._vlmrl_weight_group = join_group(WeightGroup(**group), rank)
        return rank

    def vlmrl_leave_weight_group(self) -> None:
        leave_group(getattr(self, "_vlmrl_weight_group", None))
        self._vlmrl_weight_group = None

    def vlmrl_weights_checksum(self) -> str:
        """sha256 of this rank's parameters (names sorted, raw bytes)."""
        import hashlib

        import torch

        digest = hashlib.sha256()
        for name, param in sorted(self.get_model().named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def vlmrl_receive_bucket(self, meta: dict[str, Any]) -> int:
        """One bucket from rank 0's broadcast, loaded by the model's own load_weights (between the weight-sync
        extension's begin and finish)."""
        from vllm.config import set_current_vllm_config

        pg = getattr(self, "_vlmrl_weight_group", None)
        if pg is None:
            raise RuntimeError("no weight group joined")
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        pairs = receive_bucket(pg, BucketMeta(**meta), device)
        with set_current_vllm_config(self.vllm_config):
            self.get_model().load_weights(iter(pairs))
        return len(pairs)


class VLLMWeightGroup:
    """The vLLM backend's group calls (mixed into `VLLMBackend`; `self.llm`, `self._runner` are the backend's)."""

    weight_group_backends = ("gloo", "nccl")

    def _join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        fields = dataclasses.asdict(group)
        try:
            self._runner.call(f"join the weight group {group.name}",
                              lambda: self.llm.collective_rpc("vlmrl_join_weight_group", args=(fields, rank_offset)),
                              group.timeout_s + 30)
        except RolloutError as err:
            # vLLM's multiprocess executor answers an RPC at its first failed rank: the other ranks' late replies
            # stay queued and would answer the next RPC (measured at TP 2), so this engine takes no further calls
            self._runner.broken = f"joining weight group {group.name} failed ({err})"
            raise RolloutError(f"{self.name}: could not join weight group {group.name} at {group.address}:"
                               f"{group.port}: {err}") from err
        self._weight_group = group.name

    def leave_weight_group(self) -> None:
        if getattr(self, "_weight_group", None) is not None and self.llm is not None:
            self._runner.call("leave the weight group", lambda: self.llm.collective_rpc("vlmrl_leave_weight_group"),
                              self.rollout.timeout_s)
        self._weight_group = None

    def _begin_receive(self) -> None:
        if getattr(self, "_weight_group", None) is None:
            raise RolloutError(f"{self.name}: no weight group joined (join_weight_group first)")
        self._runner.call("begin the weight update", lambda: self.llm.collective_rpc("vlmrl_begin_reload"),
                          self.rollout.timeout_s)

    def _receive_bucket(self, meta: BucketMeta) -> int:
        fields = dataclasses.asdict(meta)
        try:
            counts = self._runner.call(f"receive {len(meta.names)} tensors",
                                       lambda: self.llm.collective_rpc("vlmrl_receive_bucket", args=(fields,)),
                                       self.rollout.timeout_s)
        except BaseException as err:
            # some layers already hold new weights and the others wait on the meta device: unusable
            self._runner.broken = f"a weight load over the group failed half-way ({type(err).__name__}: {err})"
            raise
        return counts[0]

    def weights_checksum(self) -> str:
        import hashlib

        ranks = self._runner.call("checksum the weights", lambda: self.llm.collective_rpc("vlmrl_weights_checksum"),
                                  self.rollout.timeout_s)
        return hashlib.sha256("".join(ranks).encode()).hexdigest()

    def _end_receive(self) -> None:
        self._runner.call("finish the weight update", self._finish_reload, self.rollout.timeout_s)
