"""Weight sync planning, shared by every backend: trainer names -> the checkpoint names the engine loads (through
the model's family), tied copies left out (and refused when they differ), tensors cast to the engine's dtype and
moved to the CPU a bucket of rollout.sync_bucket_mb at a time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from vlmrl.models.experts import ExpertShape, convert, convert_names
from vlmrl.models.families import ModelFamily

TIED_COPIES = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
"""Transformers-5 name of a tensor that tied-embedding models (Qwen2.5-VL-3B, Qwen3-VL-2B/4B) share with another ->
that other one. Their checkpoints hold only the latter (save_pretrained drops the copy), while transformers'
state_dict() lists both."""


def tied_copies(family: ModelFamily) -> dict[str, str]:
    """TIED_COPIES in the checkpoint names of this family.

    >>> from vlmrl.models.families import QWEN2_5_VL, QWEN3_VL
    >>> tied_copies(QWEN2_5_VL), tied_copies(QWEN3_VL)
    ({'lm_head.weight': 'model.embed_tokens.weight'}, {'lm_head.weight': 'model.language_model.embed_tokens.weight'})
    """
    name = family.weights.checkpoint_name
    return {name(copy): name(source) for copy, source in TIED_COPIES.items()}


@dataclass
class WeightSync:
    """What one `update_weights` call loads: every checkpoint name, known before the first tensor is read (so a
    backend can refuse a wrong set before its engine sees anything), and the tensors in buckets."""

    names: set[str]
    """Checkpoint names the buckets will hold (tied copies the checkpoint does not hold left out)."""
    buckets: Iterator[dict[str, torch.Tensor]]
    """{checkpoint name: contiguous CPU tensor in the engine's dtype}, each bucket at most the bucket size (a larger
    tensor alone); lazily read: a gathering actor gathers as the buckets are consumed."""


@dataclass(frozen=True)
class SyncRecipe:
    """Everything `weight_sync` needs besides the tensors, for one backend: what a process that holds the weights
    but not the backend (a training rank sending over the weight group) cuts the same sync with
    (`RolloutBackend.sync_recipe`)."""

    model_names: frozenset[str]
    """The checkpoint names of the engine's model (`checkpoint_names`); empty = unknown."""
    dtype: torch.dtype | None
    """The engine's dtype; None = as given."""
    bucket_bytes: int
    """rollout.sync_bucket_mb in bytes; <= 0: one bucket."""
    backend: str
    family: ModelFamily
    experts: tuple[str, ExpertShape] | None = None

    def plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None) -> WeightSync:
        return weight_sync(named_tensors, names, set(self.model_names), self.dtype, self.bucket_bytes, self.backend,
                           self.family, self.experts)


def weight_sync(named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None,
                model_names: set[str], dtype: torch.dtype | None, bucket_bytes: int, backend: str,
                family: ModelFamily, experts: tuple[str, ExpertShape] | None = None) -> WeightSync:
    """Plan a bucketed weight sync (rollout.sync_bucket_mb): names checked first, then tensors cast to the engine's
    `dtype` (floating ones), moved to the CPU and grouped `bucket_bytes` at a time, so host memory holds about one
    bucket however large the model. bucket_bytes <= 0: one bucket of everything.

    Args:
        named_tensors: (transformers or checkpoint name, tensor) pairs, read once, in order.
        names: their names in that order, when `named_tensors` is a stream that must not be read twice (a sharded
            actor gathers each tensor as it is read); None = read `named_tensors` into a list of references first.
        model_names: the checkpoint names of the engine's model (`checkpoint_names`); empty = unknown.
        dtype: the engine's dtype; None = as given.
        family: the model's family: its checkpoint names are what the engine loads.
        experts: (the engine's expert layout, the model's expert sizes) for a Mixture-of-Experts model: transformers'
            fused expert tensors are converted into that layout as they are read (`vlmrl.models.experts.convert`,
            shapes checked); None = as given.

    A tied copy the checkpoint does not hold (`tied_copies(family)`) is left out; one that differs from the tensor it
    is tied to is refused (the engine has one tensor for both): before anything is sent when the values are at hand,
    else when the copy is read.
    """
    if names is None:
        named_tensors = list(named_tensors)  # references to tensors that exist anyway: no copy
        names = [name for name, _ in named_tensors]
        values = {family.weights.checkpoint_name(name): tensor for name, tensor in named_tensors}
    else:
        values = None
    if experts is not None:
        names = convert_names(names, *experts)
        named_tensors = convert(named_tensors, *experts)
    keys = [family.weights.checkpoint_name(name) for name in names]
    if not keys:
        raise ValueError("update_weights got no tensors")
    seen: set[str] = set()
    for name, key in zip(names, keys):
        if key in seen:
            raise ValueError(f"weight {key!r} given twice (as {name!r})")
        seen.add(key)
    dropped = {copy: source for copy, source in tied_copies(family).items()
               if model_names and copy not in model_names and copy in seen and source in seen}
    if values is not None:
        for copy, source in dropped.items():
            if not torch.equal(values[copy].to(values[source].dtype), values[source]):
                raise ValueError(_untied(copy, source, backend))
    return WeightSync(seen - set(dropped), _buckets(named_tensors, keys, dropped, dtype, bucket_bytes, backend,
                                                        family))


def _untied(copy: str, source: str, backend: str) -> str:
    return (f"{backend}: the model ties {copy} to {source} (its checkpoint holds only the latter), but the weights "
            "sent differ: the trainer untied them, which the engine cannot follow")


def _fingerprint(tensor: torch.Tensor) -> bytes:
    """A digest of the tensor's bytes: compares a tied copy with its source without keeping the source."""
    import hashlib

    return hashlib.blake2b(tensor.reshape(-1).view(torch.uint8).numpy(), digest_size=32).digest()


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], keys: list[str], dropped: dict[str, str],
             dtype: torch.dtype | None, bucket_bytes: int, backend: str, family: ModelFamily
             ) -> Iterator[dict[str, torch.Tensor]]:
    sources = {source: copy for copy, source in dropped.items()}
    prints: dict[str, bytes] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    read = 0
    for (name, tensor), key in zip(named_tensors, keys, strict=True):
        read += 1
        if family.weights.checkpoint_name(name) != key:
            raise ValueError(f"{backend}: weight {read} is {name!r}, not the announced {key!r}")
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            # on the trainer's device: half the bytes to move for a bf16 engine; float32 where the engine keeps it
            keep = any(part in key for part in family.engines.float32_in_engines)
            tensor = tensor.to(torch.promote_types(dtype, torch.float32) if keep else dtype)
        tensor = tensor.to("cpu").contiguous()
        if key in sources or key in dropped:
            prints[key] = _fingerprint(tensor)
            pair = (key, sources[key]) if key in sources else (dropped[key], key)
            if all(k in prints for k in pair) and prints[pair[0]] != prints[pair[1]]:
                raise ValueError(_untied(pair[1], pair[0], backend))
            if key in dropped:
                continue
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and bucket_bytes > 0 and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[key] = tensor
        size += nbytes
    if bucket:
        yield bucket


def checkpoint_names(model_path: str) -> set[str]:
    """Names of every tensor in a model folder's safetensors files (headers only, nothing loaded)."""
    from pathlib import Path

    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


