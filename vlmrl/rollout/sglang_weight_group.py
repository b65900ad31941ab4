"""SGLang's side of a collective weight group (`vlmrl.rollout.weight_group`): its own weight update group
(`init_weights_update_group`, which every TP rank joins at the rank offset plus its TP rank) and
`update_weights_from_distributed` with `load_format="flattened_bucket"` (one broadcast per bucket, the layout
`pack_bucket` writes), between `begin_weight_update` and `end_weight_update` as a tensor sync is; and SGLang's own
weight checker for the engine's checksum. Mixed into `SGLangBackend` (`self.engine`, `self._runner` are its)."""

from __future__ import annotations

from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.weight_group import BucketMeta, WeightGroup


class SGLangWeightGroup:
    weight_group_backends = ("gloo", "nccl")  # init_weights_update_group takes either (gloo measured on CPU)

    def _join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self.leave_weight_group()
        ok, message = self._runner.call(
            f"join the weight group {group.name}",
            lambda: self.engine.init_weights_update_group(group.address, group.port, rank_offset, group.world_size,
                                                          group.name, group.backend), group.timeout_s + 30)[:2]
        if not ok:
            raise RolloutError(f"{self.name}: init_weights_update_group refused: {message}")
        self._weight_group = group.name

    def leave_weight_group(self) -> None:
        name, self._weight_group = getattr(self, "_weight_group", None), None
        if name is not None and self.engine is not None:
            self._runner.call("leave the weight group", lambda: self.engine.destroy_weights_update_group(name),
                              self.rollout.timeout_s)

    def _begin_receive(self) -> None:
        if getattr(self, "_weight_group", None) is None:
            raise RolloutError(f"{self.name}: no weight group joined (join_weight_group first)")
        self._runner.call("begin the weight update", self.engine.begin_weight_update, self.rollout.timeout_s)

    def _receive_bucket(self, meta: BucketMeta) -> int:
        ok, message = self._runner.call(
            f"receive {len(meta.names)} tensors", lambda: self.engine.update_weights_from_distributed(
                list(meta.names), list(meta.dtypes), [list(s) for s in meta.shapes], self._weight_group,
                flush_cache=False, load_format="flattened_bucket"), self.rollout.timeout_s)[:2]
        if not ok:
            raise RolloutError(f"{self.name}: update_weights_from_distributed refused ({message}); the engine holds "
                               "some new weights and some old: a full weight load must land before it generates")
        return len(meta.names)

    def weights_checksum(self) -> str:
        """SGLang's own weight checker (`check_weights` action=checksum): every TP rank's checksum, as one."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        def checksum():
            manager = self.engine.tokenizer_manager
            return self.engine.loop.run_until_complete(manager.check_weights(CheckWeightsReqInput(), None))

        ok, message, _, digest = self._runner.call("checksum the weights", checksum, self.rollout.timeout_s)
        if not ok or digest is None:
            raise RolloutError(f"{self.name}: check_weights refused: {message}")
        return digest

    def _end_receive(self) -> None:
        try:
            self._flush_cache()
        finally:
            self._runner.call("end the weight update", self.engine.end_weight_update, self.rollout.timeout_s)
        self.weight_version += 1
