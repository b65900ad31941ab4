"""What the MoE engine tests share: the routing a transformers reference gives a sequence, and the rule for a
bfloat16 engine's greedy split that sits where the routing itself is not settled in bfloat16."""

from __future__ import annotations

import torch

from tests.rollout.helpers import common_prefix, greedy_mismatch
from vlmrl.actor.routing import RouterHooks


def routing(hf, request, response_ids) -> torch.Tensor:
    """(MoE layers, tokens, k) top-k expert ids of the HF backend's model over the request's expanded prompt plus
    `response_ids`, sorted within each top-k set."""
    hooks = getattr(hf.model, "_test_router_hooks", None)
    if hooks is None:
        hooks = hf.model._test_router_hooks = RouterHooks(hf.model, hf.processor.family.experts.router_class)
    inputs = hf._model_inputs(request, response_ids)
    length = inputs["input_ids"].shape[1]
    with torch.no_grad(), hooks.record(torch.ones(length, dtype=torch.bool), [length]) as recorded:
        hf.model(**inputs, use_cache=False)
    return recorded[0].to(torch.long).sort(dim=-1).values


def unsettled_routing_before(hf32, hf16, request, response_ids, position: int) -> bool:
    """Whether transformers routes some token up to the one that predicts response token `position` through other
    experts in float32 than in bfloat16: the experts such a token takes are decided by bfloat16 rounding, so a
    bfloat16 engine may take the other ones there and legitimately continue differently."""
    ids = list(response_ids[:position])
    a, b = routing(hf32, request, ids), routing(hf16, request, ids)
    return not torch.equal(a, b)


def moe_greedy_problems(refs, gots, requests, hf32, hf16, backend: str, logprob_tol: float, tie_tol: float):
    """greedy_problems for a bfloat16 MoE engine: a split is allowed at a near-tie (as for any bfloat16 engine) or
    after a token whose routing transformers itself decides differently in float32 and bfloat16; the logprobs over
    the common prefix before any routing-unsettled token stay within `logprob_tol`."""
    problems = []
    for ref, got, request in zip(refs, gots, requests, strict=True):
        message = greedy_mismatch(ref, got, backend, tie_tol)
        upto = common_prefix(ref.response_ids, got.response_ids)
        if message is not None and "(near-tie" not in message \
                and not unsettled_routing_before(hf32, hf16, request, ref.response_ids, upto):
            problems.append(message + " - and transformers routes every token before it alike in float32 and "
                                      "bfloat16")
        drift = max([abs(x - y) for x, y in zip(ref.response_logprobs[:upto], got.response_logprobs[:upto])],
                    default=0.0)
        if drift > logprob_tol:
            problems.append(f"{ref.uid}: logprobs over the {upto} common tokens differ by {drift:.3g} > "
                            f"{logprob_tol:g}")
    return problems
