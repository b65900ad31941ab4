"""Determinism and consistency gates of one rollout backend (`python -m vlmrl.alignment.compare --gate NAME`).

    reproducibility  the same engine, the same requests and seed, twice: the same tokens and logprobs
    batch            each request alone (with the seed it gets at its batch position) vs all in one batch
    cross-instance   two engine instances, started one after the other on the same config: the same results
    diversity        at temperature > 0, the n samples of a prompt are not clones of each other
    trajectory       with agent.enable: each multi-turn trajectory's ids, built turn by turn, are the chat template's
                     rendering of its final conversation (`vlmrl.alignment.trajectory_check`)
    all              the four (one instance for the first three, a second for cross-instance), and trajectory with
                     agent.enable

The gate logic is pure functions over RolloutResult lists (`equal_results`, `diversity_gate`); `run_gates` produces
the results on a real backend (`vlmrl.rollout.registry.start_backend`, i.e. `get_backend`). Sampling: rollout.n samples per
prompt at rollout.temperature (1.0 when it is 0), rollout.top_p / top_k, data.max_response_length tokens, seeded
with trainer.seed, on the first `rows` rows of data.val_files (else data.train_files).

The diversity rule: in a group of n samples whose most repeated response appears m >= 2 times, with sequence
probability p (exp of the sum of its raw token logprobs), independent draws repeat some response of probability
<= p at least m times with chance <= C(n, m) p^(m-1) (a union bound). The group fails when that bound is below
alpha / groups (default alpha 0.01), so correct sampling fails the gate with chance < alpha over all groups, while
a deterministic mode that clones the samples of a group (and silently zeroes GRPO's advantages) fails on any
response that is not near-certain. A confident model repeating an answer of p ~ 1 is correctly not flagged. The
probabilities are exact at temperature 1 without top-p/top-k; otherwise the raw logprobs only approximate the
sampling distribution (the report says so).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrl.atomic import write_text_atomically

if TYPE_CHECKING:  # the compare tool imports this module and must load without torch
    from vlmrl.types import RolloutResult, SamplingParams

logger = logging.getLogger(__name__)

GATES = ("reproducibility", "batch", "cross-instance", "diversity")
AGENT_GATES = ("trajectory",)
"""Gates that run the agent loop (agent.enable)."""
DEFAULT_LOGPROB_TOLERANCE = 1e-4
"""Largest |logprob delta| per token between two runs that must agree (fp32 engines agree to ~1e-5 across batch
shapes; the tokens must match exactly)."""
DEFAULT_ALPHA = 0.01
FINDINGS_SHOWN = 5


@dataclass
class GateResult:
    """One gate's verdict."""

    name: str
    ok: bool
    checked: int
    """Samples compared (diversity: groups judged)."""
    findings: list[str] = field(default_factory=list)
    """One line per sample (or group) that fails, in words."""
    note: str = ""


def _key(result: RolloutResult) -> tuple[str, int]:
    return result.uid, result.sample_index


def sample_difference(a: RolloutResult, b: RolloutResult, tolerance: float) -> str | None:
    """How two results of the same sample differ, in words; None when they agree (tokens equal, finish equal,
    logprobs within `tolerance`)."""
    if a.response_ids != b.response_ids:
        split = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y),
                     min(len(a.response_ids), len(b.response_ids)))
        return (f"tokens split at position {split} (lengths {len(a.response_ids)} vs {len(b.response_ids)})")
    if a.finish_reason != b.finish_reason:
        return f"finish reason {a.finish_reason} vs {b.finish_reason}"
    worst = max((abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)), default=0.0)
    if not worst <= tolerance:  # `not <=` catches NaN
        return f"same tokens, logprobs up to {worst:.3g} nats apart (tolerance {tolerance:g})"
    return None


def equal_results(name: str, a: Sequence[RolloutResult], b: Sequence[RolloutResult], labels: tuple[str, str],
                  tolerance: float = DEFAULT_LOGPROB_TOLERANCE) -> GateResult:
    """Gate `name`: every sample of `a` equals its twin (same uid and sample index) in `b`."""
    by_key = {_key(r): r for r in b}
    missing = sorted({_key(r) for r in a} ^ by_key.keys())
    findings = [f"sample {uid}#{i} is in only one of {labels[0]} / {labels[1]}" for uid, i in missing]
    for result in a:
        other = by_key.get(_key(result))
        if other is not None and (why := sample_difference(result, other, tolerance)):
            findings.append(f"{result.uid}#{result.sample_index}: {labels[0]} vs {labels[1]}: {why}")
    return GateResult(name, not findings, len(a), findings)


def reproducibility_gate(first: Sequence[RolloutResult], second: Sequence[RolloutResult],
                         tolerance: float = DEFAULT_LOGPROB_TOLERANCE) -> GateResult:
    """The same engine given the same requests and seed twice must give the same results."""
    return equal_results("reproducibility", first, second, ("run 1", "run 2"), tolerance)


def batch_invariance_gate(alone: Sequence[RolloutResult], batched: Sequence[RolloutResult],
                          tolerance: float = DEFAULT_LOGPROB_TOLERANCE) -> GateResult:
    """A request generated alone (with the seed of its batch position) must give what it gives in the batch."""
    return equal_results("batch", alone, batched, ("alone", "in the batch"), tolerance)


def cross_instance_gate(a: Sequence[RolloutResult], b: Sequence[RolloutResult],
                        tolerance: float = DEFAULT_LOGPROB_TOLERANCE) -> GateResult:
    """Two instances of the engine on the same config must give the same results."""
    return equal_results("cross-instance", a, b, ("instance 1", "instance 2"), tolerance)


def exact_sampling(sampling: SamplingParams) -> bool:
    """Whether the raw logprobs are the sampling distribution's: temperature 1, no top-p, no top-k."""
    return sampling.temperature == 1.0 and sampling.top_p >= 1.0 and sampling.top_k <= 0


def diversity_gate(results: Sequence[RolloutResult], sampling: SamplingParams,
                   alpha: float = DEFAULT_ALPHA) -> GateResult:
    """The samples of each prompt (uid) are not clones: see the module docstring for the rule."""
    if sampling.greedy:
        raise ValueError("the diversity gate needs temperature > 0: greedy samples are identical by design")
    groups: dict[str, list[RolloutResult]] = defaultdict(list)
    for result in results:
        groups[result.uid].append(result)
    judged = {uid: group for uid, group in groups.items() if len(group) > 1}
    limit = alpha / max(len(judged), 1)
    findings = []
    for uid, group in judged.items():
        counts = Counter(tuple(r.response_ids) for r in group)
        response, m = counts.most_common(1)[0]
        if m < 2:
            continue
        twin = next(r for r in group if tuple(r.response_ids) == response)
        log_p = math.fsum(twin.response_logprobs)
        n = len(group)
        log_bound = math.log(math.comb(n, m)) + (m - 1) * log_p
        if log_bound < math.log(limit):
            findings.append(f"{uid}: {m} of {n} samples are the same response ({len(counts)} distinct, "
                            f"{len(response)} tokens, logprob {log_p:.3g}): independent draws repeat it this often "
                            f"with chance <= {math.exp(log_bound):.2g} (limit {limit:.2g})")
    note = "" if exact_sampling(sampling) else (
        f"temperature {sampling.temperature}, top_p {sampling.top_p}, top_k {sampling.top_k}: the raw logprobs only "
        "approximate the sampling probabilities")
    return GateResult("diversity", not findings, len(judged), findings, note)


# ---------------------------------------------------------------------------------------------------- real backends


def gate_sampling(config) -> SamplingParams:
    """The sampling every gate runs with (see the module docstring)."""
    from vlmrl.types import SamplingParams

    r = config.rollout
    return SamplingParams(n=r.n, temperature=r.temperature or 1.0, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=config.data.max_response_length, seed=config.trainer.seed)


def gate_requests(config, rows: int) -> list:
    """The requests of the first `rows` rows of data.val_files (else data.train_files), built by the run's
    processor."""
    return gate_inputs(config, rows)[2]


def gate_inputs(config, rows: int) -> tuple:
    """(processor, dataset, requests) of `gate_requests`."""
    from vlmrl.data.dataset import build_requests, load_dataset
    from vlmrl.processors.loading import load_processor

    d = config.data
    spec, split = (d.val_files, "val") if d.val_files else (d.train_files, "train")
    dataset = load_dataset(spec, split, prompt_key=d.prompt_key, image_key=d.image_key,
                           synthetic_train_size=d.synthetic_train_size, synthetic_val_size=d.synthetic_val_size,
                           synthetic_seed=config.trainer.seed)
    processor = load_processor(config.actor.model_path, d)
    return processor, dataset, build_requests(processor, dataset, list(range(min(rows, len(dataset))))).requests


def _start(config, backend: str):
    from vlmrl.rollout.registry import start_backend

    return start_backend(config.rollout, config.actor.model_path, name=backend, seed=config.trainer.seed,
                         max_model_len=config.derived.max_model_len)


def run_gates(config, backend: str, gates: Sequence[str], rows: int = 8,
              tolerance: float = DEFAULT_LOGPROB_TOLERANCE, alpha: float = DEFAULT_ALPHA) -> list[GateResult]:
    """Generate what `gates` need on `backend` and judge it. One instance serves reproducibility, batch and
    diversity; cross-instance closes it and starts a second (never two at once: they would share memory)."""
    from vlmrl.rollout.requests import sample_seed

    if set(gates) & set(AGENT_GATES) and not config.agent.enable:
        raise ValueError("--gate trajectory checks multi-turn trajectories: set agent.enable=true and the agent's "
                         "tools (agent.tools), as for an agent run")
    processor, dataset, requests = gate_inputs(config, rows)
    if not requests:
        raise ValueError("no request to run the gates on (every row filtered?)")
    sampling = gate_sampling(config)
    out = []
    with _start(config, backend) as engine:
        logger.info("gates on %s: %d requests x %d samples, temperature %g, seed %s", backend, len(requests),
                    sampling.n, sampling.temperature, sampling.seed)
        first = engine.generate(requests, sampling)
        if "reproducibility" in gates:
            out.append(reproducibility_gate(first, engine.generate(requests, sampling), tolerance))
        if "batch" in gates:
            alone = [result for position, request in enumerate(requests) for result in
                     engine.generate([request], replace(sampling, seed=sample_seed(sampling, position)))]
            out.append(batch_invariance_gate(alone, first, tolerance))
        if "diversity" in gates:
            out.append(diversity_gate(first, sampling, alpha))
        if "trajectory" in gates:
            out.append(trajectory_gate(config, engine, processor, dataset, requests, sampling))
    if "cross-instance" in gates:
        with _start(config, backend) as engine:
            out.append(cross_instance_gate(first, engine.generate(requests, sampling), tolerance))
    order = {name: i for i, name in enumerate((*GATES, *AGENT_GATES))}
    return sorted(out, key=lambda g: order[g.name])


def trajectory_gate(config, engine, processor, dataset, requests, sampling) -> GateResult:
    """The agent loop on `requests` over `engine`; every trajectory checked by `check_trajectory`."""
    from vlmrl.agent.loop import AgentLoop
    from vlmrl.alignment.trajectory_check import check_trajectory

    with AgentLoop(engine, processor, config.agent, prompt_length=config.data.max_prompt_length,
                   response_length=config.data.max_response_length) as agent:
        batch = agent.run(requests, sampling)
    n = len(batch.samples) // max(len(batch.requests), 1)
    findings, kinds, tool_turns = [], Counter(), 0
    for k, sample in enumerate(batch.samples):
        request = batch.requests[k // n]
        tool_turns += len(sample.tool_turns)
        found = check_trajectory(processor, processor.prompt_messages(dataset[request.index], request.index),
                                 request.prompt_ids, sample.turn_ids, sample.turn_mask, sample.tool_turns,
                                 config.agent.tool_turn_format, index=request.index, sample_index=sample.sample_index)
        if found is not None:
            findings.append(found.line())
            kinds[found.kind] += 1
    note = f"{tool_turns} tool turns over {len(batch.samples)} trajectories"
    if kinds:
        note += "; " + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
    return GateResult("trajectory", not findings, len(batch.samples), findings, note)


def write_gate_report(results: Sequence[GateResult], backend: str, path: Path) -> Path:
    payload = {"kind": "vlmrl.gates", "format_version": 1, "backend": backend,
               "ok": all(g.ok for g in results), "gates": [asdict(g) for g in results]}
    return write_text_atomically(path, json.dumps(payload, indent=1) + "\n")


def summary_lines(results: Sequence[GateResult]) -> list[str]:
    lines = []
    for gate in results:
        lines.append(f"{'PASS' if gate.ok else 'FAIL'} {gate.name}: {gate.checked} checked, {len(gate.findings)} "
                     "failing" + (f" ({gate.note})" if gate.note else ""))
        lines += [f"  {finding}" for finding in gate.findings[:FINDINGS_SHOWN]]
        if len(gate.findings) > FINDINGS_SHOWN:
            lines.append(f"  ... {len(gate.findings) - FINDINGS_SHOWN} more in the report")
    return lines
