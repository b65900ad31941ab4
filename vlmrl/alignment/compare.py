"""python -m vlmrl.alignment.compare: are two backends' validation outputs the same, and if not, where and why?

    python -m vlmrl.alignment.compare A.jsonl B.jsonl [--out DIR] [--max-real-divergence 0.02 ...]
    python -m vlmrl.alignment.compare --backends vllm,sglang config=FILE.yaml key=value ... [--out DIR]
    python -m vlmrl.alignment.compare --backends trainer,vllm config=FILE.yaml key=value ... [--out DIR]
    python -m vlmrl.alignment.compare --gate all [--backend vllm] config=FILE.yaml key=value ... [--out DIR]

The first form diffs two artifacts written by validate-only mode (`trainer.val_only=true`). The second runs that
validation on both backends itself (same data, images and seeds; greedy by default), then diffs. Writes
DIR/report.json and DIR/report.html and prints a one-screen summary.

`--backends X,Y` checks both sides' configs first (a bad one exits 2 before any engine starts), then runs the
validate-only CLI once per backend, each in its own process, one after the other (two engines never share memory):
`python -m vlmrl.train <overrides> trainer.val_only=true rollout.name=X trainer.output_dir=DIR/run_a_X`. Each run's
output is shown as it comes and kept in DIR/val_a_X.log; its artifact becomes DIR/val_a_X.jsonl (val_b_Y for the
second side). A run must end within rollout.start_timeout_s + 4 x rollout.timeout_s (x agent.max_turns with
agent.enable) + 10 minutes; every engine call inside it has its own deadline as well.

`--backends trainer,X` (either order) puts the trainer on one side: X validates first as above, then
`python -m vlmrl.trainer.teacher_forcing` builds the actor from the same config (actor.model_path, actor.* settings:
dtype, packing, micro-batches, chunked logprobs, LoRA) and scores X's samples teacher-forced through the update's
logprob pass (`vlmrl.trainer.teacher_forcing`). The tokens then agree by construction, at any temperature, and the
diff is about inputs (the trainer rebuilds every request), logprobs and their causes.

`--gate NAME` judges one backend (rollout.name, or --backend) against itself instead: reproducibility, batch,
cross-instance, diversity, trajectory (agent.enable: the turn-by-turn ids against the chat template's rendering) or
all (`vlmrl.alignment.gates`); it writes DIR/gates.json.

Exit status: 0 aligned within the thresholds (every gate passes), 1 not aligned (a gate fails), 2 bad usage,
unreadable / incomparable artifacts, or a backend's run that failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from vlmrl.alignment.artifact import ArtifactError, read_artifact
from vlmrl.alignment.causes import Thresholds
from vlmrl.alignment.diff import NotComparableError, compare_artifacts
from vlmrl.alignment.gates import (
    AGENT_GATES,
    DEFAULT_ALPHA,
    DEFAULT_LOGPROB_TOLERANCE,
    GATES,
    run_gates,
    summary_lines,
    write_gate_report,
)
from vlmrl.alignment.html_report import write_html_report
from vlmrl.alignment.precision import FP32_THRESHOLDS, Precision, precision_of
from vlmrl.alignment.report import print_summary, write_json_report
from vlmrl.config import ROLLOUT_BACKENDS, Config, ConfigError, field_docs, load_config
from vlmrl.rollout.registry import cpu_env
from vlmrl.utils.processes import kill_tree

logger = logging.getLogger(__name__)

EXIT_ALIGNED, EXIT_NOT_ALIGNED, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = "outputs/alignment"
RUN_CALLS_MARGIN = 4
"""A backend's run may take this many engine calls' worth of rollout.timeout_s (times agent.max_turns)."""
RUN_SETUP_S = 600.0
"""Besides engine calls and start-up: interpreter, imports, data, scoring and writing the artifact."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `vlmrl`, for the child's sys.path


class UsageError(ValueError):
    """Bad command line or config (exit 2)."""


class BackendRunError(RuntimeError):
    """A backend's validate-only run failed or overran (exit 2: there is nothing to compare)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlmrl.alignment.compare",
        description="Diff two backends' validation outputs at four levels (inputs, tokens, logprobs, rewards), "
        "bucket every differing sample by cause, and exit 0 when they agree within the thresholds.",
        epilog="Exit status: 0 aligned (with --gate: every gate passes), 1 not aligned (a gate fails), 2 bad usage, "
        "unreadable/incomparable artifacts or a failed backend run. With --backends each backend validates in its "
        "own `python -m vlmrl.train` process, which must "
        f"end within rollout.start_timeout_s + {RUN_CALLS_MARGIN} x rollout.timeout_s (x agent.max_turns with "
        f"agent.enable) + {RUN_SETUP_S:g} s.",
    )
    parser.add_argument("inputs", nargs="*", metavar="A.jsonl B.jsonl | key=value",
                        help="two artifacts; with --backends: config=FILE.yaml and dotted key=value overrides")
    parser.add_argument("--backends", metavar="X,Y",
                        help="run validation on these two backends (of hf, vllm, sglang, sglang-server), each in its "
                        "own process, and compare; one may be `trainer`: the actor, built with the run's actor.* "
                        "settings, scores the other side's samples teacher-forced")
    parser.add_argument("--drill-down", action="store_true",
                        help="with the trainer as a side: name the first module (vision merger/tower, decoder layer, "
                        "final norm, head) whose output departs from transformers' on the worst sample")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for report.json/report.html, and with --backends the artifacts and run logs "
                        f"(default {DEFAULT_OUT})")
    parser.add_argument("--no-html", action="store_true", help="skip the HTML report")
    gates = parser.add_argument_group("gates (one backend against itself; key=value overrides as with --backends)")
    gates.add_argument("--gate", choices=[*GATES, *AGENT_GATES, "all"],
                       help="run a determinism / consistency gate instead of a comparison (see docs/alignment.md)")
    gates.add_argument("--backend", help="the backend the gate runs on (default rollout.name)")
    gates.add_argument("--gate-rows", type=int, default=8, metavar="N", help="data rows the gate generates for "
                       "(rollout.n samples each; default 8)")
    gates.add_argument("--gate-logprob-tolerance", type=float, default=DEFAULT_LOGPROB_TOLERANCE, metavar="X",
                       help=f"per-token |logprob delta| two runs may differ by (default {DEFAULT_LOGPROB_TOLERANCE:g}"
                       "; tokens must match)")
    gates.add_argument("--gate-alpha", type=float, default=DEFAULT_ALPHA, metavar="X",
                       help=f"the diversity gate's false-alarm chance over all groups (default {DEFAULT_ALPHA:g})")
    docs = field_docs(Thresholds)
    group = parser.add_argument_group("thresholds (when the two sides count as aligned)")
    for f in dataclasses.fields(Thresholds):
        fp32 = f"; {FP32_THRESHOLDS[f.name]} when both sides computed in float32, as their headers record" \
            if f.name in FP32_THRESHOLDS else ""
        group.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=None, metavar="X",
                           help=f"{docs.get(f.name, '')} (default {f.default}{fp32})")
    return parser


def thresholds_from(args: argparse.Namespace, precision: Precision) -> Thresholds:
    """The thresholds given on the command line; the others at the defaults the sides' dtypes choose."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Thresholds) if getattr(args, f.name) is not None}
    return Thresholds(**{**precision.defaults, **given})


def _artifact_paths(args: argparse.Namespace, out: Path) -> list[Path]:
    """The two artifacts to compare: given on the command line, or produced now by running validation twice."""
    if not args.backends:
        if len(args.inputs) != 2 or any("=" in item for item in args.inputs):
            raise UsageError("give exactly two artifact files (A.jsonl B.jsonl), or --backends X,Y with key=value "
                             "overrides")
        return [Path(item) for item in args.inputs]
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    if len(backends) != 2:
        raise UsageError(f"--backends needs exactly two names separated by a comma, got {args.backends!r}")
    bad = [item for item in args.inputs if "=" not in item]
    if bad:
        raise UsageError(f"with --backends, arguments must be config=FILE.yaml or key=value; got {bad}")
    if args.drill_down and "trainer" not in backends:
        raise UsageError("--drill-down needs the trainer as a side (--backends trainer,X): the engines expose no "
                         "per-module outputs")
    return run_backends(backends, list(args.inputs), out, drill=args.drill_down)


# ---------------------------------------------------------------------------------------------------- --backends


def _side_overrides(overrides: list[str], backend: str, run_dir: Path, moe: bool = False) -> list[str]:
    """A side's validate-only overrides; a MoE model's engine side records its routing (cause `routing`) unless the
    overrides say otherwise: vllm everywhere, sglang on a GPU (its capture needs CUDA)."""
    import torch

    section = {"vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang"}.get(backend)
    key = f"rollout.{section}.capture_routing="
    captures = section == "vllm" or (section == "sglang" and torch.cuda.is_available())
    routing = ([f"{key}true"] if moe and captures and not any(o.startswith(key) for o in overrides) else [])
    return [*overrides, *routing, "trainer.val_only=true", f"rollout.name={backend}", f"trainer.output_dir={run_dir}"]


def _is_moe(config: Config) -> bool:
    from vlmrl.models.families import family_for_path
    from vlmrl.models.tiny import resolve_model_path

    try:
        return family_for_path(resolve_model_path(config.actor.model_path)).experts is not None
    except (OSError, ValueError):
        return False


def run_timeout_s(config: Config) -> float:
    """How long one backend's validate-only process may run (the bound in the module docstring)."""
    turns = config.agent.max_turns if config.agent.enable else 1
    return config.rollout.start_timeout_s + RUN_CALLS_MARGIN * turns * config.rollout.timeout_s + RUN_SETUP_S


def run_backends(backends: list[str], overrides: list[str], out_dir: Path, drill: bool = False) -> list[Path]:
    """Validate with each backend under the same config, each in its own `python -m vlmrl.train` process; returns
    the artifact paths (out_dir/val_a_<backend>.jsonl, out_dir/val_b_<backend>.jsonl).

    Both sides run what validate-only mode runs under the same config: the same rows, images resized by the same
    processor, the same prompt ids, sampling settings and seeds (greedy by default: `rollout.val_temperature=0`);
    only `rollout.name` differs. One side may be `trainer` (`vlmrl.trainer.teacher_forcing`): the engine side runs
    first, then the trainer scores its samples teacher-forced in its own process (`drill`: with the per-module
    drill-down on the worst sample, `vlmrl.alignment.drill_down`). Config problems raise UsageError;
    a failed run raises BackendRunError naming its log.
    """
    from vlmrl.alignment.trainer_side import SIDE_MODULE, TRAINER, TrainerSideError, check_config

    unknown = [name for name in backends if name not in (*ROLLOUT_BACKENDS, TRAINER)]
    if unknown:
        raise UsageError(f"unknown backend(s) {unknown}; choose two of {[*ROLLOUT_BACKENDS, TRAINER]}")
    if backends.count(TRAINER) == 2:
        raise UsageError("--backends trainer,trainer: the trainer side scores an engine's samples; pair it with an "
                         f"engine ({', '.join(ROLLOUT_BACKENDS)})")
    engine = next(name for name in backends if name != TRAINER)
    sides = [(side, backend, out_dir / f"run_{side}_{backend}") for side, backend in zip("ab", backends)]
    configs = []
    for _, backend, run_dir in sides:  # check both configs before starting any engine
        try:
            configs.append(load_config(_side_overrides(overrides, engine if backend == TRAINER else backend, run_dir)))
            if backend == TRAINER:
                check_config(configs[-1], drill=drill)
        except (ConfigError, TrainerSideError) as err:
            raise UsageError(str(err)) from None
    moe = _is_moe(configs[0])
    if configs[0].rollout.val_top_logprobs == 0 and TRAINER not in backends:
        logger.warning("rollout.val_top_logprobs=0: divergences cannot be judged near-tie or real (set it to 5)")
    paths = {}
    order = sorted(range(2), key=lambda i: backends[i] == TRAINER)  # the engine first: the trainer scores its samples
    for i in order:
        (side, backend, run_dir), config = sides[i], configs[i]
        path = out_dir / f"val_{side}_{backend}.jsonl"
        for stale in [path, *run_dir.glob(f"validation_{backend}_step*.jsonl")]:  # a failed run leaves none behind
            stale.unlink(missing_ok=True)
        log = out_dir / f"val_{side}_{backend}.log"
        started = time.perf_counter()
        if backend == TRAINER:
            reference = paths[1 - i]
            logger.info("side %s: the trainer scores %s's samples teacher-forced in its own process -> %s",
                        side.upper(), engine, path)
            arguments = [*_side_overrides(overrides, engine, run_dir, moe), "--reference", str(reference), "--out",
                         str(path), *(["--drill-down"] if drill else [])]
            _validate_in_subprocess(arguments, f"{side.upper()} {backend}", log, run_timeout_s(config),
                                    cpu_env(config.rollout), module=SIDE_MODULE)
        else:
            logger.info("side %s: validating %s with %s in its own process -> %s", side.upper(),
                        config.actor.model_path, backend, path)
            _validate_in_subprocess(_side_overrides(overrides, backend, run_dir, moe), f"{side.upper()} {backend}",
                                    log, run_timeout_s(config), cpu_env(config.rollout))
            _take_artifact(run_dir, backend, path)
        logger.info("side %s: %s done in %.1f s", side.upper(), backend, time.perf_counter() - started)
        paths[i] = path
    return [paths[0], paths[1]]


def _validate_in_subprocess(overrides: list[str], label: str, log_path: Path, timeout_s: float,
                            engine_env: dict[str, str], module: str = "vlmrl.train") -> None:
    """Runs `python -m <module> <overrides>` (validate-only, or the trainer side); its output goes to stderr (each
    line prefixed `[label]`) and to log_path. `engine_env`: the side's engine settings on a CPU, under this process's
    environment (an explicit value wins). Raises BackendRunError when it exits non-zero or runs past timeout_s (then
    it is killed)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", module, *overrides]
    # In the side's environment from its start, so every process it starts (SGLang's scheduler, vLLM's engine
    # core) has them before it imports its engine.
    env = {**engine_env, **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, text=True, errors="replace", bufsize=1)
        copier = threading.Thread(target=_copy_lines, args=(process.stdout, log, f"[{label}] "), daemon=True)
        copier.start()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BackendRunError(f"side {label}: the validation run did not finish within {timeout_s:g} s (the "
                                  "bound in --help; raise rollout.timeout_s for a longer validation) and was "
                                  f"stopped; its log: {log_path}") from None
        finally:
            if process.poll() is None:  # overran, or Ctrl-C here: the engine must not outlive the compare tool
                kill_tree(process.pid, grace_s=10)
                process.wait()
            copier.join(timeout=10)
    if process.returncode != 0:
        raise BackendRunError(f"side {label}: the validation run exited with status {process.returncode}; "
                              f"its log: {log_path} (last lines above)")


def _copy_lines(stream, log, prefix: str) -> None:
    """The child's output, line by line, to its log and (prefixed) to stderr, so a person sees the run progress."""
    for line in stream:
        log.write(line)
        log.flush()
        sys.stderr.write(prefix + line)


def _take_artifact(run_dir: Path, backend: str, path: Path) -> None:
    """Moves the run's artifact (run_dir/validation_<backend>_step<N>.jsonl, as validate-only mode names it) to
    `path` in one rename, so `path` is either the whole new artifact or absent."""
    found = sorted(run_dir.glob(f"validation_{backend}_step*.jsonl"))
    if len(found) != 1:
        raise BackendRunError(f"{backend}: expected one validation_{backend}_step<N>.jsonl in {run_dir}, found "
                              f"{[f.name for f in found]}")
    os.replace(found[0], path)


def run_gate_mode(args: argparse.Namespace, out: Path, err: Console) -> int:
    """--gate: the gates on one backend, in this process (the engine is started here, one instance at a time)."""
    from vlmrl.rollout.errors import RolloutError

    bad = [item for item in args.inputs if "=" not in item]
    if bad or args.backends:
        err.print(Text("error: ", style="bold red") + Text(f"--gate takes config=FILE.yaml and key=value overrides "
                                                           f"(and --backend NAME), not {bad or ['--backends']}"))
        return EXIT_USAGE
    try:
        config = load_config(list(args.inputs))
        backend = args.backend or config.rollout.name
        if backend not in ROLLOUT_BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {list(ROLLOUT_BACKENDS)}")
        names = [*GATES, *(AGENT_GATES if config.agent.enable else ())] if args.gate == "all" else [args.gate]
        results = run_gates(config, backend, names, rows=args.gate_rows, tolerance=args.gate_logprob_tolerance,
                            alpha=args.gate_alpha)
    except (ConfigError, UsageError, ValueError, RolloutError) as error:
        err.print(Text("error: ", style="bold red") + Text(str(error)))
        return EXIT_USAGE
    path = write_gate_report(results, backend, out / "gates.json")
    for line in summary_lines(results):
        print(line)
    ok = all(gate.ok for gate in results)
    print(f"{backend}: {'every gate passes' if ok else 'GATE FAILED'} | report: {path}")
    return EXIT_ALIGNED if ok else EXIT_NOT_ALIGNED


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    except SystemExit as exit_:  # argparse exits 2 on bad usage and 0 on --help
        return int(exit_.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    console = Console()
    err = Console(stderr=True, soft_wrap=True)  # an error line stays one line: the paths in it copy whole
    out = Path(args.out)
    if args.gate:
        return run_gate_mode(args, out, err)
    try:
        path_a, path_b = _artifact_paths(args, out)
        meta_a, records_a = read_artifact(path_a)
        meta_b, records_b = read_artifact(path_b)
        thresholds = thresholds_from(args, precision_of(meta_a, meta_b))
        comparison = compare_artifacts(meta_a, records_a, meta_b, records_b, thresholds)
    except (UsageError, BackendRunError, ArtifactError, NotComparableError) as error:
        err.print(Text("error: ", style="bold red") + Text(str(error)))
        return EXIT_USAGE
    written = [write_json_report(comparison, out / "report.json")]
    if not args.no_html:
        written.append(write_html_report(comparison, records_a, records_b, out / "report.html"))
    print_summary(comparison, console, written)
    return EXIT_ALIGNED if comparison.ok else EXIT_NOT_ALIGNED



if __name__ == "__main__":
    sys.exit(main())
