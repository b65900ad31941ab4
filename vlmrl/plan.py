"""`python -m vlmrl.plan config=FILE.yaml [key=value ...] [--device-gb 80] [--json]`: the memory plan of a run.

Per device, phase by phase (rollout, weight sync, logprob passes, update, optimizer step): the trainer's FSDP2
shards of parameters, gradients and optimizer state, the activations of one micro-batch, the colocated engine's
weights and KV cache at rollout.tensor_parallel_size and what sleeps when; then the verdict for devices of
--device-gb GiB (as torch reports a device's memory: an "80 GB" H100 reports 79.2) and the smallest engine TP, of
those that divide the devices, that fits. The model's shapes come from its config.json, without its weights (a hub
id not downloaded: the released configs vlmrl ships). What each row counts: docs/memory.md.

Exit status: 0 it fits, 1 it does not, 2 the config is invalid (one `error:` line).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from vlmrl.config import ActorConfig, ConfigError, load_config

def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        args, device_gib, as_json = _options(args)
        config = load_config(args)  # the run's every rule, TP's too (k divides the devices; a local model's heads)
        from vlmrl.trainer.memory_model import model_facts

        facts = model_facts(config.actor)
        d = config.algorithm.distill  # the distillation teacher: its own shapes (another size of the family)
        teacher = model_facts(ActorConfig(model_path=d.teacher)) if d.enabled else None
        from vlmrl.trainer.memory_plan import head_problem, memory_plan

        split = head_problem(config.rollout.tensor_parallel_size, facts)  # a hub id's heads: read here, not at load
        if split:
            raise ConfigError(split)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    plan = memory_plan(config, facts, device_gib, teacher=teacher)
    print(json.dumps(as_dict(plan), indent=2) if as_json else render(plan))
    return 0 if plan.fits else 1


def _options(args: list[str]) -> tuple[list[str], float, bool]:
    """(the config arguments, --device-gb, --json)."""
    rest, device, as_json = [], 80.0, False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--json":
            as_json = True
        elif arg == "--device-gb" or arg.startswith("--device-gb="):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            i += 0 if "=" in arg else 1
            try:
                device = float(value)
            except ValueError:
                raise ConfigError(f"--device-gb {value!r} is not a number of GiB (e.g. --device-gb 80)") from None
            if device <= 0:
                raise ConfigError(f"--device-gb {value} must be > 0")
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {arg}: the plan takes config=FILE.yaml, key=value, --device-gb N, "
                              "--json")
        else:
            rest.append(arg)
        i += 1
    return rest, device, as_json


def _g(value: float) -> str:
    return f"{value / 2**30:.1f}"


def render(plan) -> str:
    """The plan as a table (GiB per device, a column per phase) and a one-line verdict."""
    from vlmrl.trainer.memory_plan import PHASES

    mb, engine = plan.micro_batch, plan.engine
    lines = [f"memory plan: {plan.model} ({plan.family}, {plan.parameters / 1e9:.2f}B parameters, "
             f"{plan.trainable / 1e9:.3g}B trained; config.json: {plan.source})",
             f"  {plan.dp} device(s) of {_g(plan.device)} GiB, FSDP2 over dp={plan.dp}"
             + (f", engine {engine.backend} at TP {plan.tp} ({plan.dp // plan.tp} engine(s))" if engine else
                ", no engine on the training devices"),
             f"  micro-batch: {mb.rows} row(s) x {mb.length} tokens{' packed' if mb.packed else ''}, "
             f"{mb.image_tokens} image tokens; activations {_g(plan.activations[0])}-{_g(plan.activations[1])} GiB "
             "(the plan counts the upper bound)", ""]
    labels: list[str] = []
    for phase in plan.phases:
        labels += [label for label in phase.items if label not in labels]
    width = max(len(label) for label in labels) + 2
    lines.append("  GiB per device".ljust(width + 2) + "".join(name.rjust(16) for name in PHASES))
    for label in labels:
        values = [phase.items.get(label, 0) for phase in plan.phases]
        if any(values):
            lines.append(f"  {label}".ljust(width + 2) + "".join((_g(v) if v else "-").rjust(16) for v in values))
    lines.append("  total".ljust(width + 2) + "".join(_g(phase.total).rjust(16) for phase in plan.phases))
    lines.append("")
    if engine is not None:
        lines.append(f"  engine rank: {_g(engine.budget)} GiB awake = weights {_g(engine.weights)} + KV cache "
                     f"{_g(max(engine.kv_cache, 0))} ({engine.kv_tokens:,} tokens, {engine.sequences} full-length "
                     f"requests at once) + activations and graphs {_g(engine.reserve)}; {engine.sleep}")
    host = {label: value for label, value in plan.host.items() if value}
    if host:
        lines.append("  host memory per device: " + ", ".join(f"{label} {_g(v)} GiB" for label, v in host.items()))
    lines.append("  engine TP: " + "; ".join(f"{k} fits ({peak:.1f} GiB)" if ok else
                                             f"{k} no ({re.sub(r' [(][^)]*[)]: pick .*', '', why)})"
                                             for k, (ok, peak, why) in plan.options.items()))
    smallest = plan.smallest_tp
    tail = f"smallest TP that fits: {smallest}" if smallest else "no TP that divides the devices fits"
    peak = plan.peak
    if plan.fits:
        verdict = (f"verdict: fits {plan.dp} x {_g(plan.device)} GiB at TP {plan.tp}: peak {_g(peak.total)} GiB per "
                   f"device ({peak.name}); {tail}")
    else:
        verdict = f"verdict: does not fit {plan.dp} x {_g(plan.device)} GiB at TP {plan.tp}: " + "; ".join(
            plan.problems) + f"; {tail}"
    return "\n".join([*lines, verdict])


def as_dict(plan) -> dict[str, Any]:
    """The plan for machines: every figure in GiB."""
    def gib(value: float) -> float:
        return round(value / 2**30, 3)

    engine = plan.engine
    return {
        "model": plan.model, "family": plan.family, "config_json": plan.source, "parameters": plan.parameters,
        "trainable": plan.trainable, "devices": plan.dp, "device_gib": gib(plan.device), "tp": plan.tp,
        "fits": plan.fits, "problems": plan.problems, "peak": {"phase": plan.peak.name, "gib": gib(plan.peak.total)},
        "phases": {phase.name: {"total_gib": gib(phase.total), "items_gib": {k: gib(v) for k, v in
                                                                            phase.items.items()}}
                   for phase in plan.phases},
        "engine": None if engine is None else {
            "backend": engine.backend, "tp": engine.tp, "awake_gib": gib(engine.budget),
            "weights_gib": gib(engine.weights), "kv_cache_gib": gib(max(engine.kv_cache, 0)),
            "activations_gib": gib(engine.reserve), "kv_tokens": engine.kv_tokens, "sequences": engine.sequences,
            "releases_memory": engine.releases, "between_rollouts": engine.sleep},
        "host_gib": {k: gib(v) for k, v in plan.host.items() if v},
        "micro_batch": {"rows": plan.micro_batch.rows, "length": plan.micro_batch.length,
                        "image_tokens": plan.micro_batch.image_tokens, "packed": plan.micro_batch.packed},
        "activations_gib": {"lower": gib(plan.activations[0]), "upper": gib(plan.activations[1])},
        "tp_options": {str(k): {"fits": ok, "peak_gib": peak, "why_not": why}
                       for k, (ok, peak, why) in plan.options.items()},
        "smallest_tp": plan.smallest_tp,
    }


if __name__ == "__main__":
    sys.exit(main())
