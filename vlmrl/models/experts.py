"""The routed experts of Mixture-of-Experts VLMs (Qwen3-VL-MoE, Qwen3.5-MoE): their tensor layouts, and the one
conversion between them that checkpoints and weight sync use.

transformers 5.19 holds a decoder layer's routed experts as two fused 3D parameters, whatever the checkpoint held:

    mlp.experts.gate_up_proj   (E, 2*I, H)   each expert's gate rows, then its up rows
    mlp.experts.down_proj      (E, H, I)

A family's checkpoints (what transformers, vLLM and SGLang all load) hold them in one of two other layouts:

    fused-transposed (Qwen3-VL-MoE's released checkpoints): the same names, (E, H, 2*I) and (E, I, H). transformers
        transposes them on load; vLLM and SGLang read fused names only this way. transformers 5.19's own
        `save_pretrained` writes the in-memory orientation instead, which both engines fail to load.
    per-expert (Qwen3.5-MoE's): mlp.experts.{e}.gate_proj.weight (I, H), .up_proj.weight (I, H), .down_proj.weight
        (H, I). transformers' `save_pretrained` writes this for Qwen3.5-MoE, and fuses it again on load.

Every tensor is checked against the shape the config gives before it is converted, and nothing is transposed on a
guess: a tensor whose shape does not say its orientation (2*I == H) is refused by `check_orientable`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LAYOUTS = ("fused", "fused-transposed", "per-expert")
"""fused: transformers' in-memory tensors; the other two: the checkpoint layouts above."""

FUSED_NAME = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)"
                             r"\.weight$")
"""A fused expert tensor's name (in memory, or fused-transposed in a checkpoint); a per-expert one's."""


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts' sizes of one model: E experts of intermediate size I over hidden size H."""

    experts: int
    intermediate: int
    hidden: int

    @classmethod
    def of(cls, model_config: Mapping[str, Any] | Any) -> ExpertShape:
        """From config.json (a dict) or a transformers config object (its text config)."""
        if isinstance(model_config, Mapping):
            text = model_config.get("text_config") or model_config
            get = text.get
        else:
            text = getattr(model_config, "text_config", model_config)

            def get(key, default=None):
                return getattr(text, key, default)
        # Qwen3-VL-MoE's config.json says num_local_experts (transformers 5.19 maps num_experts onto it), Qwen3.5-MoE's
        # num_experts
        experts = get("num_experts") or get("num_local_experts")
        return cls(int(experts), int(get("moe_intermediate_size")), int(get("hidden_size")))

    def fused(self, kind: str) -> tuple[int, int, int]:
        """transformers' in-memory shape of `gate_up_proj` / `down_proj`."""
        e, i, h = self.experts, self.intermediate, self.hidden
        return (e, 2 * i, h) if kind == "gate_up_proj" else (e, h, i)

    def check_orientable(self) -> None:
        """Refuse a model whose fused gate_up tensor reads the same both ways (2*I == H): a transposed copy would load
        into every engine without an error."""
        if 2 * self.intermediate == self.hidden:
            raise ValueError(f"MoE experts with 2 x moe_intermediate_size == hidden_size ({self.hidden}): the "
                             "orientation of a fused expert tensor cannot be told from its shape")


def convert_names(names: Iterable[str], layout: str, shape: ExpertShape) -> list[str]:
    """In-memory (fused) names -> the names `convert` gives in `layout`, in its order."""
    out: list[str] = []
    for name in names:
        m = FUSED_NAME.match(name)
        if m is None or layout != "per-expert":
            out.append(name)
            continue
        kinds = ("gate_proj", "up_proj") if m["kind"] == "gate_up_proj" else ("down_proj",)
        out += [f"{m['prefix']}.{e}.{kind}.weight" for e in range(shape.experts) for kind in kinds]
    return out


def convert(named_tensors: Iterable[tuple[str, torch.Tensor]], layout: str, shape: ExpertShape
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory tensors -> `layout`, lazily and in order (per expert: expert 0's gate, up, then expert
    1's...; down tensors per expert). Other tensors pass as they are. A fused tensor of another shape than the
    config's is refused, naming it: it was transposed somewhere already, or belongs to another model."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r}; one of {LAYOUTS}")
    for name, tensor in named_tensors:
        m = FUSED_NAME.match(name)
        if m is None:
            yield name, tensor
            continue
        expected = shape.fused(m["kind"])
        if tuple(tensor.shape) != expected:
            axes = "2 x intermediate, hidden" if m["kind"] == "gate_up_proj" else "hidden, intermediate"
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, but transformers holds it as {expected} "
                             f"(experts, {axes}) for this config: refusing to guess its orientation")
        if layout == "fused":
            yield name, tensor
        elif layout == "fused-transposed":
            yield name, tensor.transpose(1, 2).contiguous()
        elif m["kind"] == "gate_up_proj":
            for e, weight in enumerate(tensor.unbind(0)):
                gate, up = weight.chunk(2, dim=0)
                yield f"{m['prefix']}.{e}.gate_proj.weight", gate.contiguous()
                yield f"{m['prefix']}.{e}.up_proj.weight", up.contiguous()
        else:
            for e, weight in enumerate(tensor.unbind(0)):
                yield f"{m['prefix']}.{e}.down_proj.weight", weight.contiguous()


def to_fused(state: Mapping[str, torch.Tensor], layout: str, shape: ExpertShape) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in `layout` -> transformers' in-memory fused ones (the inverse of `convert`), shapes
    checked: what a test compares with the model's own parameters."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = PER_EXPERT_NAME.match(name)
        if m is not None:
            groups.setdefault(m["prefix"], {}).setdefault(int(m["expert"]), {})[m["kind"]] = tensor
            continue
        m = FUSED_NAME.match(name)
        if m is not None and layout == "fused-transposed":
            tensor = tensor.transpose(1, 2)
        if m is not None and tuple(tensor.shape) != shape.fused(m["kind"]):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)} does not fit the {layout} layout of this "
                             f"config ({shape})")
        out[name] = tensor
    for prefix, experts in groups.items():
        if sorted(experts) != list(range(shape.experts)):
            raise ValueError(f"{prefix}: experts {sorted(experts)} of {shape.experts}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                     for e in range(shape.experts)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(shape.experts)])
    return out


# ---------------------------------------------------------------------------------------------------- engine routing


@dataclass(frozen=True)
class RoutingLayout:
    """How the engines report a MoE model's routing: per computed token, one row of top-k expert ids for every
    decoder layer (`hidden_layers` rows, vLLM's and SGLang's `enable_return_routed_experts`), of which `moe_layers`
    route through experts; vlmrl keeps those, as (MoE layers, tokens, top-k) like the trainer's own record
    (`vlmrl.actor.router_hooks`)."""

    hidden_layers: int
    moe_layers: tuple[int, ...]
    top_k: int

    @classmethod
    def of(cls, model_config: Mapping[str, Any]) -> RoutingLayout:
        """From config.json: transformers' rule for a MoE decoder layer (Qwen3-VL-MoE's `Qwen3VLMoeTextDecoderLayer`:
        not in mlp_only_layers, and (index + 1) divisible by decoder_sparse_step; Qwen3.5-MoE has neither key, so
        every layer)."""
        from vlmrl.models.families import dense_layers

        text = model_config.get("text_config") or model_config
        layers = int(text["num_hidden_layers"])
        dense = set(dense_layers(text))
        moe = tuple(i for i in range(layers) if i not in dense)
        return cls(layers, moe, int(text["num_experts_per_tok"]))

    def from_engine(self, rows: Any, source: str) -> torch.Tensor:
        """(MoE layers, tokens, top-k) long ids from an engine's (tokens, layers, top-k) rows (a numpy array, or a
        flat one as SGLang's base64 int32 payload decodes). Refuses rows of another shape rather than guess."""
        ids = (rows if isinstance(rows, torch.Tensor) else torch.tensor(np.asarray(rows))).to(torch.long)
        if ids.dim() == 1:
            width = self.hidden_layers * self.top_k
            if ids.numel() % width:
                raise ValueError(f"{source}: {ids.numel()} routed-expert ids do not divide into tokens of "
                                 f"{self.hidden_layers} layers x top-{self.top_k}")
            ids = ids.reshape(-1, self.hidden_layers, self.top_k)
        if ids.dim() != 3 or ids.shape[1:] not in ((self.hidden_layers, self.top_k),
                                                   (len(self.moe_layers), self.top_k)):
            raise ValueError(f"{source}: routed experts of shape {tuple(ids.shape)}; expected (tokens, "
                             f"{self.hidden_layers} layers, top-{self.top_k})")
        if ids.shape[1] == self.hidden_layers:
            ids = ids[:, list(self.moe_layers)]
        return ids.permute(1, 0, 2).contiguous()
