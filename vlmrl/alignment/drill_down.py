"""Where a divergence starts: the first module whose output differs beyond tolerance between two in-process models on
one sample (`compare --backends X,trainer --drill-down`).

The two sides are transformers models of the same family: the trainer's policy (its weights, dtype, packing) and a
reference built as the HF backend builds it, from the engine side's model_path in the engine side's dtype. Both run
the trainer's logprob pass (`forward_response`) on the same sample, the trainer in its own layout (packed with
actor.padding_free) and the reference padded; a single row has the same token order in both, so every watched
module's output lines up position for position. Watched, in forward order: the vision tower's mergers (Qwen3-VL:
its deepstack mergers too) and the tower itself, each decoder layer, the final norm, and the head (the response's
logprobs). The first whose max |difference| exceeds `tolerance` x max |reference output| is named. On a MoE model
both sides' routers are recorded too, and the first MoE layer (and token) whose top-k experts differ is named.

The engines run other kernels in other processes, so this compares the trainer with transformers on the engine's
weights, not with the engine itself: vLLM and SGLang expose no per-layer outputs to a client (SGLang's tensor dump
and vLLM's intermediate-tensor logging are debugging switches of the engine process, not a return value).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

logger = logging.getLogger(__name__)

FLOAT32_TOLERANCE = 1e-4
"""Relative tolerance when both sides compute in float32 (correct kernels agree to ~1e-6 there)."""
BFLOAT16_TOLERANCE = 5e-2
"""Relative tolerance when a side computes in bfloat16 (its 8-bit mantissa rounds at ~4e-3 per operation)."""


@dataclass
class ModuleDiff:
    name: str
    max_abs: float
    """max |trainer - reference| over the module's output."""
    scale: float
    """max |reference| of that output (the tolerance is relative to it)."""
    differs: bool


@dataclass
class DrillDown:
    """The per-module comparison on one sample, in forward order, and the first module beyond tolerance."""

    index: int
    sample_index: int
    tolerance: float
    modules: list[ModuleDiff] = field(default_factory=list)
    first: str | None = None
    """The first module whose output differs beyond tolerance; None when none does."""
    routing: dict | None = None
    """A MoE model: where the two sides' routers chose other experts for the sample's tokens
    (`vlmrl.alignment.routing.RoutingAgreement` as a dict: first_layer, first_token, differing pairs); None for a
    dense model."""

    def to_dict(self) -> dict:
        return asdict(self)


PEFT_PREFIX = "base_model.model."
"""What PEFT puts before every module name of a LoRA policy; names are compared without it."""


def canonical(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def watched_modules(model: torch.nn.Module, vision_tower: str, mergers: tuple[str, ...],
                    projector: str | None = None) -> list[str]:
    """The model's module names in forward order: vision mergers (and deepstack mergers) and the tower, a projector
    after it (InternVL), decoder layers, final norm."""
    names = {canonical(n): n for n, _ in model.named_modules()}
    out = [names[f"{vision_tower}.{m}"] for m in mergers if f"{vision_tower}.{m}" in names]
    out += [names[f"{vision_tower}.{m}.{i}"] for m in mergers for i in range(64) if f"{vision_tower}.{m}.{i}" in names]
    out += [names[vision_tower]] if vision_tower in names else []
    out += [names[projector]] if projector in names else []
    layers = sorted((n for n in names if n.rsplit(".", 1)[-1].isdigit() and n.rsplit(".", 1)[0].endswith(
        "language_model.layers")), key=lambda n: int(n.rsplit(".", 1)[-1]))
    out += [names[n] for n in layers]
    norm = next((n for n in names if n.endswith("language_model.norm")), None)
    return out + ([names[norm]] if norm else [])


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    for key in ("pooler_output", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def capture(model: torch.nn.Module, names: list[str], run) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Runs `run()` with a forward hook on each named module; returns their (last) outputs as float64, by canonical
    name, and run()'s result."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        def hook(_module, _inputs, output, name=name):
            tensor = _first_tensor(output)
            if tensor is not None:
                seen[canonical(name)] = tensor.detach().to(torch.float64).reshape(-1, tensor.shape[-1]).clone()
        handles.append(modules[name].register_forward_hook(hook))
    try:
        with torch.no_grad():
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    return seen, result


def compare_modules(trainer: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names: list[str],
                    tolerance: float) -> tuple[list[ModuleDiff], str | None]:
    """Per module in `names` that both sides produced with the same shape: max |difference| against tolerance x
    max |reference|; and the first module beyond it."""
    out, first = [], None
    for name in names:
        a, b = trainer.get(name), reference.get(name)
        if a is None or b is None or a.shape != b.shape:
            continue
        max_abs, scale = float((a - b).abs().max()), float(b.abs().max())
        differs = not max_abs <= tolerance * max(scale, 1e-12)
        out.append(ModuleDiff(name, max_abs, scale, differs))
        if differs and first is None:
            first = name
    return out, first


def drill_down(actor, reference_model: torch.nn.Module, batch, row: int, *, family, index: int, sample_index: int,
               tolerance: float) -> DrillDown:
    """The per-module comparison of the trainer's policy and `reference_model` on row `row` of `batch` (a scored
    batch of the engine's samples)."""
    from vlmrl.actor.forward import forward_response, micro_batch

    weights = family.weights
    names = watched_modules(actor.model, weights.vision_tower, weights.vision_mergers, weights.vision_projector)
    reference_names = watched_modules(reference_model, weights.vision_tower, weights.vision_mergers,
                                      weights.vision_projector)
    trainer_mb = micro_batch(batch, [row], actor.device, packed=actor.config.padding_free)
    reference_mb = micro_batch(batch, [row], next(reference_model.parameters()).device)

    def trainer_pass():
        actor.model.eval()
        with actor.autocast():
            return forward_response(actor.model, trainer_mb, 1.0, False, chunk=actor.config.logprob_chunk_size)[0]

    def reference_pass():
        return forward_response(reference_model, reference_mb, 1.0, False)[0]

    routes: dict[str, torch.Tensor] = {}
    if family.experts is not None:  # the routers too: which MoE layer first sends a token to other experts
        from vlmrl.actor.router_hooks import RouterHooks

        trainer_hooks = getattr(actor, "routing", None) or RouterHooks(actor.model, family.experts.router_class)
        reference_hooks = RouterHooks(reference_model, family.experts.router_class)
        trainer_pass = _recording(trainer_pass, trainer_hooks, trainer_mb, routes, "trainer")
        reference_pass = _recording(reference_pass, reference_hooks, reference_mb, routes, "reference")
    trainer_out, trainer_lp = capture(actor.model, names, trainer_pass)
    reference_out, reference_lp = capture(reference_model, reference_names, reference_pass)
    width = int(batch.response_mask[row].sum()) or 1
    trainer_out["head"] = trainer_lp[..., :width].to(torch.float64).reshape(1, -1)
    reference_out["head"] = reference_lp[..., :width].to(torch.float64).reshape(1, -1)
    modules, first = compare_modules(trainer_out, reference_out, [*map(canonical, names), "head"], tolerance)
    routing = None
    if routes:
        from vlmrl.alignment.routing import compare_routing

        routing = asdict(compare_routing(routes["trainer"], routes["reference"]))
    return DrillDown(index, sample_index, tolerance, modules, first, routing)


def _recording(run, hooks, mb, routes: dict[str, torch.Tensor], side: str):
    """`run` with the routers' choices of the micro-batch's one row kept in routes[side] ((layers, tokens, k))."""
    def recorded():
        with hooks.record(mb.attended(), mb.token_lengths) as out:
            result = run()
        routes[side] = out[0]
        return result
    return recorded
