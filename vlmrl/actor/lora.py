"""LoRA for the policy (PEFT): which layers get adapters, the reference as the base with adapters disabled, merged
weights for the engines, and the adapter files vLLM serves and checkpoints keep.

    model = apply_lora(model, config.lora)                   # PeftModel; only lora_A / lora_B require grad
    with adapters_disabled(model): ...                        # the base model: the KL reference, exactly
    merged_tensors(model.state_dict().items(), scaling)       # (HF name, base + scaling * B @ A), streamed
    merged_names(model.state_dict())                          # the same names, in the same order, without tensors
    write_adapter(folder, model.state_dict().items(), peft_config)   # adapter_model.safetensors + adapter_config.json

Names. Inside a PeftModel every weight is `base_model.model.<HF name>`; an adapted Linear's own weight becomes
`<module>.base_layer.weight` beside `<module>.lora_A.default.weight` / `lora_B.default.weight`. `merged_tensors` and
`adapter_tensors` work on such (name, tensor) pairs from any source, a plain model's state dict or the gathered
shards of an FSDP2 model, so the single-process and the sharded actor sync and save through the same code.

Experts (lora.experts). A MoE layer's routed experts are two fused 3D parameters, not Linear layers: PEFT adapts
them with `target_parameters`, one ParamWrapper per parameter, nested around the experts module in the order it
registers them (the first innermost). A layer's experts then read

    <layer>.mlp.experts.base_layer.base_layer.gate_up_proj   (E, 2I, H)   the base parameters, under both wrappers
    <layer>.mlp.experts.base_layer.base_layer.down_proj      (E, H, I)
    <layer>.mlp.experts.base_layer.lora_A / lora_B           gate_up_proj's adapter (inner wrapper)
    <layer>.mlp.experts.lora_A / lora_B                      down_proj's adapter (outer wrapper)

and merge into `<layer>.mlp.experts.gate_up_proj` / `down_proj` with transformers' shapes, so weight sync converts
them into the engines' expert layout (`vlmrl.models.experts`) as it converts a full model's. `apply_lora` checks
that PEFT nested them so.

The merge is PEFT's own arithmetic (`LoraLayer.get_delta_weight`: (B @ A) * scaling, in float32 for a 16-bit
weight on CPU, then added to the base weight; `ParamWrapper.get_delta_weight`'s per-expert einsum for the experts),
so the merged weights equal `merge_and_unload()`'s.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vlmrl.actor.config import LoraConfig

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""What a PeftModel puts before every HF parameter name."""
ADAPTER_DIR = "adapter"
"""A checkpoint's PEFT adapter folder (beside the merged HF weights)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# a LoRA layer's parts in a state dict: its base layer, and lora_A / lora_B with (PeftModel) or without (adapter file)
# the adapter's name
_LORA_PART = re.compile(r"^(?P<module>.+)\.(?P<part>base_layer\.weight|base_layer\.bias"
                        r"|lora_[AB](?:\.[^.]+)?\.weight)$")
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused expert parameters lora.experts adapts, in the order transformers' experts modules register them: PEFT's
wrapper of the first is the innermost."""
# an expert ParamWrapper's parts: a fused parameter under `depth` wrappers, or the lora_A / lora_B of the wrapper
# with `depth` wrappers outside it
_EXPERT_PART = re.compile(r"^(?P<module>.+\.mlp\.experts)(?P<depth>(?:\.base_layer)*)\."
                          r"(?:(?P<param>gate_up_proj|down_proj)|(?P<lora>lora_[AB])(?:\.[^.]+)?\.weight)$")


def vision_patterns(model: torch.nn.Module, vision: str) -> list[str]:
    """Regexes (full match) of the vision-side Linear layers lora.vision adapts, from the model's family
    (vlmrl.models.families): `tower` = every Linear of the tower's blocks, `merger` = every Linear of its mergers
    (Qwen3-VL's deepstack mergers included), or of the projector after the tower (InternVL)."""
    from vlmrl.models.families import family_of

    family = family_of(model.config)
    tower = re.escape(family.weights.vision_tower)
    patterns = []
    if vision in ("tower", "tower+merger"):
        patterns.append(rf"{tower}\.{re.escape(family.weights.vision_blocks)}\.\d+\..+")
    if vision in ("merger", "tower+merger"):
        if family.weights.vision_projector is not None:
            patterns.append(rf"{re.escape(family.weights.vision_projector)}\..+")
        else:
            patterns.append(rf"{tower}\.({'|'.join(re.escape(m) for m in family.weights.vision_mergers)})\..+")
    return patterns


def target_modules(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Full names of the Linear layers that get adapters. On the language side: those whose name ends with one of
    lora.target_modules (PEFT's suffix rule; the default list also takes the family's linear-attention projections,
    Qwen3.5's Gated DeltaNet in_proj_qkv/z/b/a and out_proj) and is not matched whole by lora.exclude_modules. On
    the vision side (the family's vision tower): exactly the tower's and/or the merger's linear layers lora.vision
    asks for (`vision_patterns`), whatever target_modules and exclude_modules say.

    lora.vision alone decides the vision side because it alone decides what the engine serves (vLLM is started with
    tower/connector LoRA only when it is not `off`): Qwen2.5-VL's vision MLP is named gate_proj/up_proj/down_proj
    like the language model's, so the suffix rule with a narrower exclude_modules would otherwise train vision
    adapters that a LoRA-serving engine silently ignores."""
    from vlmrl.actor.config import QWEN_VL_LM_PROJECTIONS
    from vlmrl.models.families import family_of

    family = family_of(model.config)
    vision_side = family.weights.vision_prefixes
    vision = vision_patterns(model, lora.vision)
    targets = list(lora.target_modules)
    if targets == QWEN_VL_LM_PROJECTIONS:  # the default: every projection of the family's language layers
        targets += family.weights.linear_attention_projections + family.weights.fused_projections
    exclude = re.compile(lora.exclude_modules) if lora.exclude_modules else None
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name.startswith(vision_side):
            adapted = any(re.fullmatch(v, name) for v in vision)
        else:
            adapted = (any(name == t or name.endswith("." + t) for t in targets)
                       and not (exclude and exclude.fullmatch(name)))
        if adapted:
            names.append(name)
    if not names and not lora.experts:
        raise ValueError(f"actor.lora selects no Linear layer of {type(model).__name__} (target_modules="
                         f"{lora.target_modules}, exclude_modules={lora.exclude_modules!r}, vision={lora.vision})")
    return names


def expert_parameters(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Full names of the fused expert parameters that get adapters (PEFT's `target_parameters`): with lora.experts,
    every language MoE layer's `mlp.experts.gate_up_proj` and `down_proj`; else none. A dense model is refused."""
    from vlmrl.models.families import family_of

    if not lora.experts:
        return []
    family = family_of(model.config)
    if family.experts is None:
        raise ValueError(f"actor.lora.experts=true, but {type(model).__name__} ({family.name}) is a dense model: it "
                         "has no routed experts to adapt; set actor.lora.experts=false")
    vision_side = family.weights.vision_prefixes
    names = [f"{name}.{param}" for name, module in model.named_modules()
             if name.endswith(".mlp.experts") and not name.startswith(vision_side)
             for param in EXPERT_PARAMETERS if isinstance(getattr(module, param, None), torch.nn.Parameter)]
    if not names:
        raise ValueError(f"actor.lora.experts=true found no mlp.experts.{{{','.join(EXPERT_PARAMETERS)}}} parameter "
                         f"in {type(model).__name__}")
    return names


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """HF names of the layers that carry an adapter in `model` (a PeftModel, itself or wrapped), and of the fused
    expert parameters (`<layer>.mlp.experts.gate_up_proj`) with lora.experts. Not the PEFT config's
    target_modules: PEFT rewrites a long list into the shortest suffixes that select the same layers (26 layers of
    the tiny model become 11 names such as `gate_proj`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    peft_model = peft_model_of(model)
    if peft_model is None:
        return []
    return [f"{name.removeprefix(PEFT_PREFIX).replace('.base_layer', '')}.{module.parameter_name}"
            if isinstance(module, ParamWrapper) else name.removeprefix(PEFT_PREFIX)
            for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)]


def peft_config(model: torch.nn.Module, lora: LoraConfig):
    """The PEFT LoraConfig for this model: the resolved layer names (`target_modules`) and fused expert parameters
    (`expert_parameters`, PEFT's `target_parameters`) as explicit lists."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=target_modules(model, lora) or None,
                          target_parameters=expert_parameters(model, lora) or None, bias="none")


def _check_expert_nesting(model: torch.nn.Module) -> None:
    """Refuse a PeftModel whose expert wrappers nest otherwise than the merge reads them (the module docstring):
    the wrapper with k wrappers outside it must adapt EXPERT_PARAMETERS[-1 - k], else the merged experts would
    add one parameter's delta to the other."""
    from peft.tuners.lora import ParamWrapper

    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            depth = name.rsplit(".mlp.experts", 1)[-1].count(".base_layer")
            expected = EXPERT_PARAMETERS[-1 - depth] if depth < len(EXPERT_PARAMETERS) else None
            if module.parameter_name != expected:
                raise RuntimeError(f"PEFT wrapped {name} for {module.parameter_name}, where vlmrl's merge reads "
                                   f"{expected}: this PEFT release nests expert adapters otherwise")


LORA_INIT_SEED = 0
"""Seed of the adapters' initialisation (A random, B = 0): every FSDP rank builds the same adapters (sharding keeps
each rank's own values, it does not broadcast them) and dp=1 starts where dp=N does. The caller's RNG is untouched."""


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """The model wrapped by PEFT with fresh adapters (B = 0: the output is the base model's until a step is taken),
    initialised from `LORA_INIT_SEED`. Every base weight is frozen; only the adapters require grad."""
    from peft import get_peft_model

    from vlmrl.models.families import family_of

    config = peft_config(model, lora)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(LORA_INIT_SEED)
        wrapped = get_peft_model(model, config)
    _check_expert_nesting(wrapped)
    adapters = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    adapted = adapted_modules(wrapped)
    experts = [n for n in adapted if _EXPERT_PART.match(n)]
    layers = [n for n in adapted if not _EXPERT_PART.match(n)]
    vision_side = family_of(model.config).weights.vision_prefixes
    logger.info("LoRA rank %d alpha %g on %d layers (%d of the vision side; vision: %s)%s: %.3fM adapter parameters, "
                "base frozen", lora.rank, lora.alpha, len(layers), sum(n.startswith(vision_side) for n in layers),
                lora.vision, f" and {len(experts)} fused expert parameters (synced merged)" if experts else "",
                adapters / 1e6)
    return wrapped


def peft_model_of(model: torch.nn.Module):
    """The PeftModel inside `model` (itself, or wrapped by VisionAlwaysOn / FSDP2); None when there is none."""
    from peft import PeftModel

    return next((m for m in model.modules() if isinstance(m, PeftModel)), None)


def base_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a PeftModel (whose attributes are one level deeper), or the model itself."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Inside the block the model computes exactly its base model (every LoRA layer calls only its base layer): the
    KL reference without a second copy of the weights."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise ValueError("adapters_disabled needs a model with LoRA adapters (actor.lora.rank > 0)")
    # PEFT switches requires_grad off on the adapter parameters registered when the block starts and back on on
    # those registered when it ends. With FSDP2 they are not the same objects: the root unit (the vision merger,
    # lm_head) stays unsharded after a no-grad forward, so the block ends with its full-size parameters registered
    # and the sharded ones (what the optimizer steps) would stay frozen for the rest of the run (measured: the
    # merger's adapters never moved at dp=2 after the first reference pass). Restore the flags we found.
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for param in trainable:
            param.requires_grad_(True)


def lora_scaling(lora: LoraConfig) -> float:
    """PEFT's scaling of the adapter update (plain LoRA: alpha / rank)."""
    return lora.alpha / lora.rank


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: float, changed_only: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model from a PeftModel's (name, tensor) pairs: every adapted layer's weight
    is base + scaling * B @ A (PEFT's merge), every adapted fused expert parameter base + each expert's own
    scaling * B_e @ A_e (`merge_experts`), every other weight as it is (left out with `changed_only`: the base
    never changes, so an engine that takes a partial update needs only the adapted layers).

    A stream in, a stream out: a layer's merged weight is made when its last part (base, A, B) is read and yielded
    at once, so with a state dict's order (a layer's parts next to each other) one layer's parts are held at a time
    (a MoE layer's experts: both fused parameters and their adapters, yielded together when the last is read) and a
    bucketed sync holds about one bucket, not the model. `merged_names` gives the names in the same order."""
    for name, parts in _merge_events(named, changed_only):
        if isinstance(parts, torch.Tensor):
            yield name, parts
        else:
            merge, base, a, b = parts
            yield name, merge(base, a, b, scaling)


def merged_names(names: Iterable[str], changed_only: bool = False) -> list[str]:
    """The names `merged_tensors` yields, in its order, for PeftModel tensors with these names: what a backend's
    `update_weights(stream, names=...)` is told before the stream is read (nothing is read or merged here)."""
    return [name for name, _ in _merge_events(((n, None) for n in names), changed_only)]


def _merge_events(named: Iterable[tuple[str, object]], changed_only: bool) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) for a weight that passes as it is, (HF name, (merge function, base, A, B)) when a LoRA
    layer's three parts, or a MoE layer's six expert parts (two fused parameters, two adapters), are all read; the
    order of the merged stream (`merged_tensors`, `merged_names`)."""
    pending: dict[str, dict[str, object]] = {}
    wrappers = len(EXPERT_PARAMETERS)
    for name, tensor in named:
        name = name.removeprefix(PEFT_PREFIX)
        expert = _EXPERT_PART.match(name)
        if expert and (expert["lora"] or expert["depth"]):
            module, depth = expert["module"], expert["depth"].count(".base_layer")
            if (depth != wrappers) if expert["param"] else (depth >= wrappers):
                raise ValueError(f"{name}: lora.experts wraps a MoE layer's {wrappers} fused expert parameters "
                                 f"{EXPERT_PARAMETERS}, each once; this adapter wraps them otherwise")
            # the wrapper with `depth` wrappers outside it adapts EXPERT_PARAMETERS[-1 - depth] (module docstring)
            parts = pending.setdefault(module, {})
            parts[expert["param"] or f"{EXPERT_PARAMETERS[-1 - depth]}.{expert['lora']}"] = tensor
            if len(parts) == 3 * wrappers:
                del pending[module]
                for param in EXPERT_PARAMETERS:
                    yield f"{module}.{param}", (merge_experts, parts[param], parts[f"{param}.lora_A"],
                                                parts[f"{param}.lora_B"])
            continue
        match = _LORA_PART.match(name)
        if match is None or match["part"] == "base_layer.bias":
            if not changed_only:
                yield (name if match is None else f"{match['module']}.bias"), tensor
            continue
        module, part = match["module"], match["part"].split(".")[0] if "lora_" in match["part"] else match["part"]
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[module]
            yield f"{module}.weight", (merge_weight, parts["base_layer.weight"], parts["lora_A"], parts["lora_B"])
    if pending:
        raise ValueError(f"LoRA layers with missing parts: {sorted(pending)[:3]} (each needs its base weight, "
                         "lora_A and lora_B; a MoE layer's experts both fused parameters and both adapters)")


def merge_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """base + (b @ a) * scaling as PEFT merges it: a 16-bit adapter on CPU is multiplied in float32 and cast back,
    and the delta is added in place into (a copy of) the base weight, which keeps its dtype (PEFT keeps float32
    adapters on a bfloat16 base). base (out, in), a (r, in), b (out, r)."""
    low = a.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = ((b.float() @ a.float()) * scaling).to(b.dtype) if low else (b @ a) * scaling
    merged = base.clone()
    merged += delta
    return merged


def merge_experts(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """base + delta as PEFT merges a fused expert parameter (`ParamWrapper.get_delta_weight`, then `merge`): expert
    e's delta is scaling * B_e @ A_e, A_e = rows e*r..(e+1)*r of a, B_e = the columns of b at e, e + E, ... (b's
    columns are (r, E) flattened); the einsum is PEFT's own, the delta is cast to the base's dtype and added to (a
    copy of) it. base (E, out, in) as transformers holds the experts (not `is_transposed`), a (E * r, in),
    b (out, E * r)."""
    experts = base.shape[0]
    delta = torch.einsum("o r e, e r i -> e o i", b.reshape(b.shape[0], -1, experts),
                         a.reshape(experts, -1, a.shape[-1])) * scaling
    if delta.shape != base.shape:
        raise ValueError(f"an expert adapter's delta {tuple(delta.shape)} does not fit its base {tuple(base.shape)}")
    merged = base.clone()
    merged += delta.to(base.dtype)
    return merged


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{PEFT file name: tensor} of the adapter weights only, named as `PeftModel.save_pretrained` writes them
    (`base_model.model.<module>.lora_A.weight`): what vLLM loads and `load_adapter_weights` reads back."""
    out = {}
    for name, tensor in named:
        match = _LORA_PART.match(name.removeprefix(PEFT_PREFIX))
        if match and "lora_" in match["part"]:
            kind = match["part"].split(".")[0]
            out[f"{PEFT_PREFIX}{match['module']}.{kind}.weight"] = tensor.detach().to("cpu").contiguous()
    if not out:
        raise ValueError("no LoRA adapter weights among the tensors given")
    return out


def write_adapter(folder: str | Path, named: Iterable[tuple[str, torch.Tensor]], config) -> int:
    """Write a PEFT adapter folder (adapter_model.safetensors + adapter_config.json) that vLLM serves and
    `PeftModel.from_pretrained` loads. `config` is the PEFT LoraConfig. Returns the weight bytes written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(named)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    settings = config.to_dict()
    if settings["target_modules"]:  # None with lora.experts alone
        settings["target_modules"] = sorted(settings["target_modules"])
    (folder / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=1, default=str))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_adapter_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Load an adapter folder's weights (written by `write_adapter`) into the PeftModel's adapters, exactly."""
    from safetensors.torch import load_file

    if not (Path(folder) / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS} not found: the checkpoint was written without LoRA. Resume it "
                         "with actor.lora.rank=0, or train LoRA into a new trainer.output_dir")
    saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    params = {}
    for name, param in model.named_parameters():
        match = _LORA_PART.match(name.removeprefix(PEFT_PREFIX))
        if match and "lora_" in match["part"]:
            params[f"{PEFT_PREFIX}{match['module']}.{match['part'].split('.')[0]}.weight"] = param
    if set(saved) != set(params):
        missing, unknown = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise ValueError(f"adapter {folder} does not fit the model's LoRA layers (actor.lora changed?): "
                         f"{len(missing)} missing (e.g. {missing[:2]}), {len(unknown)} unknown (e.g. {unknown[:2]})")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name])


class LoraSync:
    """Pushes a LoRA policy into rollout engines, by the path actor.lora.sync picks for each backend:

    - merged: base + scaling * B @ A as full weights (`backend.update_weights`); only the adapted layers' weights
      where the backend takes a partial update (`takes_partial_weights`), since no other weight ever changes;
    - adapter: the adapter itself, written as a PEFT folder and served as a LoRA (`backend.update_adapter`; vLLM
      started with enable_lora). `auto` takes it where the backend serves adapters, else merged (logged once).
    """

    def __init__(self, lora: LoraConfig, model: torch.nn.Module):
        """lora: the actor's settings; model: the policy (its PeftModel, itself or wrapped by FSDP2), whose PEFT
        LoraConfig an adapter folder records and whose adapted layers decide what an engine can serve."""
        import tempfile

        from vlmrl.models.families import family_of

        peft_model = peft_model_of(model)
        self.lora, self.config = lora, peft_model.peft_config["default"]
        self.adapted = adapted_modules(peft_model)
        family = family_of(base_model_of(peft_model).config)
        self.vision_side = family.weights.vision_prefixes
        self.unserved_parts = family.engines.lora_unserved
        self.scaling = lora_scaling(lora)
        self.folder = Path(tempfile.mkdtemp(prefix="vlmrl-lora-sync-"))
        self.version = 0
        self._logged: set[str] = set()

    def unservable(self) -> str:
        """Why the engine's LoRA serving would ignore or refuse some of the adapters ("" when it takes them all):
        an adapter on the output head (vLLM 0.32 refuses it at load: "expected target modules in {...}"), or on the
        vision side while lora.vision=off, which starts vLLM without tower/connector LoRA
        (`vlmrl.rollout.registry.backend_options`): vLLM then loads the adapter and drops its vision layers without a
        word, and serves a policy the trainer is not training. Or adapters on the routed experts (lora.experts):
        whether vLLM serves those is unproven. Or adapters on layers the family's vLLM model takes no LoRA on
        (`EngineFacts.lora_unserved`: InternVL's projector and its tower's attention output)."""
        head = [m for m in self.adapted if m == "lm_head" or m.endswith(".lm_head")]
        vision = [m for m in self.adapted if m.startswith(self.vision_side)] if self.lora.vision == "off" else []
        experts = [m for m in self.adapted if _EXPERT_PART.match(m)]
        why = []
        if head:
            why.append(f"an adapter on {head} cannot be served as a LoRA")
        if experts:
            why.append(f"{len(experts)} expert adapters (actor.lora.experts) sync merged: serving them as a LoRA is "
                       "unproven")
        if vision:
            why.append(f"{len(vision)} vision-side adapters (e.g. {vision[0]}) would be ignored by an engine started "
                       "for actor.lora.vision=off (no tower/connector LoRA)")
        unserved = [m for m in self.adapted if any(part in f".{m}." for part in self.unserved_parts)]
        if unserved:
            why.append(f"{len(unserved)} adapters on layers vLLM serves no LoRA on for this model (e.g. "
                       f"{unserved[0]})")
        return "; ".join(why)

    def path(self, backend) -> str:
        """`adapter` or `merged` for this backend (see the class docstring)."""
        serves = backend.serves_adapters()
        unservable = self.unservable()
        if self.lora.sync == "adapter" and (not serves or unservable):
            why = unservable or f"the {backend.name} backend does not serve LoRA adapters here"
            raise ValueError(f"actor.lora.sync=adapter but {why}: set actor.lora.sync=auto or merged")
        serves = serves and not unservable
        if self.lora.sync == "auto" and not serves and backend.name not in self._logged:
            self._logged.add(backend.name)
            logger.warning("%s: LoRA adapters cannot be served by this backend here%s; syncing merged weights "
                           "(base + scaled adapter deltas) instead", backend.name,
                           f" ({unservable})" if unservable else "")
        return "adapter" if serves and self.lora.sync != "merged" else "merged"

    def push(self, backend, named: Iterable[tuple[str, torch.Tensor]], names: list[str] | None = None) -> int:
        """The policy's current weights (its PeftModel (name, tensor) pairs) into the backend; returns the bytes
        sent (adapter file, or merged tensors).

        Merged, the weights stream into `backend.update_weights` bucket by bucket (rollout.sync_bucket_mb) like a
        full fine-tuning sync: each layer is merged as its bucket fills, so host memory holds about one bucket.
        `names`: the names `named` will give, in order, when it is a stream to be read once (a sharded actor's
        gather); None = `named` is read into a list of references first."""
        if self.path(backend) == "adapter":
            self.version += 1
            folder = self.folder / f"v{self.version}"
            sent = write_adapter(folder, named, self.config)
            backend.update_adapter(str(folder))
            previous = self.folder / f"v{self.version - 1}"
            if previous.exists():  # the engine has dropped it; the new one is read when first used
                import shutil

                shutil.rmtree(previous, ignore_errors=True)
            return sent
        if names is None:
            named = list(named)  # references to the model's tensors: no copy
            names = [name for name, _ in named]
        partial = backend.takes_partial_weights()  # not after a sleep that dropped the weights
        sent = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for name, tensor in merged_tensors(named, self.scaling, changed_only=partial):
                sent += tensor.numel() * tensor.element_size()
                yield name, tensor

        backend.update_weights(counted(), names=merged_names(names, changed_only=partial))
        return sent

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
