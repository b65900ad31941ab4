"""Where two sides route a MoE model's tokens through other experts: the trainer's transformers model (its routers
recorded by `vlmrl.actor.router_hooks.RouterHooks`) against an engine's capture (`VLLMBackend.generate_with_routing`), or
two transformers models. Routing is (MoE layers, tokens, k) top-k expert ids; two sides agree on a (token, layer)
pair when their top-k SETS are equal (the order within a set does not change the computation)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RoutingAgreement:
    tokens: int
    """Tokens both sides routed (the shorter side's count)."""
    layers: int
    differing_pairs: int
    """(token, MoE layer) pairs whose top-k sets differ."""
    differing_tokens: int
    """Tokens routed differently in at least one layer."""
    first_token: int | None
    """The first token routed differently (None: none is)."""
    first_layer: int | None
    """The first MoE layer (in depth) whose routing differs at any token: where a drill-down starts."""

    def describe(self) -> str:
        if self.first_token is None:
            return f"same experts for all {self.tokens} tokens in all {self.layers} MoE layers"
        return (f"{self.differing_tokens} of {self.tokens} tokens routed through other experts "
                f"({self.differing_pairs} of {self.tokens * self.layers} (token, layer) pairs); the first at token "
                f"{self.first_token}; the first MoE layer that differs: {self.first_layer}")


def differing_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(layers, tokens) bool: where the two sides' top-k sets differ, over their common tokens."""
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"routing of {a.shape[0]} layers x top-{a.shape[2]} vs {b.shape[0]} x top-{b.shape[2]}: "
                         "not the same model")
    n = min(a.shape[1], b.shape[1])
    return (a[:, :n].sort(dim=-1).values != b[:, :n].sort(dim=-1).values).any(dim=-1)


def compare_routing(a: torch.Tensor, b: torch.Tensor) -> RoutingAgreement:
    """How two (layers, tokens, k) routings of the same sequence differ."""
    differs = differing_sets(a, b)
    per_token = differs.any(dim=0)
    per_layer = differs.any(dim=1)
    return RoutingAgreement(
        tokens=differs.shape[1], layers=differs.shape[0], differing_pairs=int(differs.sum()),
        differing_tokens=int(per_token.sum()),
        first_token=int(per_token.nonzero()[0]) if per_token.any() else None,
        first_layer=int(per_layer.nonzero()[0]) if per_layer.any() else None)


def transformers_routing(hf, request, response_ids, hooks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF backend's model routing the request's expanded prompt + `response_ids`: ((layers, tokens, k) ids,
    (layers, tokens) router margins: each token's k-th minus (k+1)-th router probability, how near its choice was
    to a tie). `hooks`: the model's RouterHooks (made and kept on the model when None)."""
    from vlmrl.actor.router_hooks import RouterHooks

    if hooks is None:
        hooks = getattr(hf.model, "_vlmrl_router_hooks", None)
        if hooks is None:
            hooks = hf.model._vlmrl_router_hooks = RouterHooks(hf.model, hf.processor.family.experts.router_class)
    inputs = hf.model_inputs(request, list(response_ids))
    length = inputs["input_ids"].shape[1]
    with torch.no_grad(), hooks.record(torch.ones(length, dtype=torch.bool), [length], margins=True) as recorded:
        hf.model(**inputs, use_cache=False)
    return recorded[0].to(torch.long), recorded["margins"][0]


def encode_routing(routing: torch.Tensor) -> dict[str, Any]:
    """(layers, tokens, k) ids -> what an artifact record holds: {"shape": [...], "int16": base64 bytes}."""
    array = routing.to(torch.int16).contiguous().numpy()
    return {"shape": list(array.shape), "int16": base64.b64encode(array.tobytes()).decode("ascii")}


def decode_routing(stored: dict[str, Any]) -> torch.Tensor:
    """The inverse of `encode_routing`."""
    array = np.frombuffer(base64.b64decode(stored["int16"]), dtype=np.int16).reshape(stored["shape"])
    return torch.from_numpy(array.astype(np.int64))


def routing_before(a: dict[str, Any] | None, b: dict[str, Any] | None, position: int) -> RoutingAgreement | None:
    """How two records' routings differ over the tokens up to `position` (of the expanded prompt + response: what
    a logit at that position depends on); None when a side has none or they agree there."""
    if a is None or b is None:
        return None
    left, right = decode_routing(a)[:, : position + 1], decode_routing(b)[:, : position + 1]
    agreement = compare_routing(left, right)
    return agreement if agreement.first_token is not None else None
