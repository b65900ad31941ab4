"""On-policy distillation on the CPU demo: steps to a validation accuracy with the demo's trained model as teacher,
side by side with the demo's own GRPO from the same fresh student and seed.

    .venv/bin/python benchmarks/bench_distill.py                    # vLLM, target 0.9, seed 1, validation every 5
    .venv/bin/python benchmarks/bench_distill.py --teacher outputs/demo/checkpoints/latest --seeds 1 2 3
    .venv/bin/python benchmarks/bench_distill.py --distill mode=loss estimator=forward_kl_topk  # RECIPE=distill
    .venv/bin/python benchmarks/bench_distill.py --quick            # 30 steps each: the script runs, no figure

Every run is the demo's config (examples/configs/tiny_synthetic.yaml: the fresh random-init tiny model, the 40-step
random-label format warm-up, then 16 prompts x 8 samples a step for at most the demo's 150 steps) at one seed; only
the advantage differs:
- grpo: the reward alone (the demo as `make demo` runs it);
- distill: algorithm.distill.teacher=TEACHER, reward_weight=0 (pure distillation; by default the per-token advantage
  -(log p_student - log p_teacher) of each sampled token, Thinking Machines' recipe, k1, no discount; --distill sets
  other algorithm.distill keys for both distillation runs);
- distill+reward: the same plus the reward's GRPO advantage at weight 1.
A run stops at the first validation at or above --target (validated every --test-freq steps, greedy, on the demo's
128 held-out rows), or at the budget: a run that does not reach the target says so instead of a step count.
Step k counts k updates after the warm-up (the warm-up, shared by all three, is not counted).

The teacher: without --teacher, the first seed's grpo run is trained to the end of the budget (the demo as it runs)
and its last checkpoint teaches every distillation run; that run's first validation at the target is its grpo step
count (the same run a stopped one would be, up to then). The ratio is grpo's steps over each distillation run's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {"grpo": [], "distill": ["algorithm.distill.reward_weight=0"], "distill+reward": []}
"""Each run's overrides beside the demo's config (the distillation runs also name the teacher)."""


def train(overrides: list[str], out: Path, target: float, stop_at_target: bool) -> dict:
    """One demo run; returns its validation curve, the first step at `target` (None if never) and its wall time."""
    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit

    if out.exists():  # a run in a folder holding one resumes it
        raise SystemExit(f"error: {out} exists: give --out a new folder")
    curve: list[tuple[int, float]] = []

    def stop(step: int, metrics: dict) -> bool:
        accuracy = metrics.get("val/accuracy")
        if accuracy is not None:
            curve.append((step, accuracy))
        return stop_at_target and step > 0 and accuracy is not None and accuracy >= target

    start = time.perf_counter()
    fit(load_config([*overrides, f"trainer.output_dir={out}"]), stop=stop)
    reached = next((step for step, accuracy in curve if step > 0 and accuracy >= target), None)
    return {"curve": curve, "steps": reached, "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="the teacher's folder (default: train it: the first seed's grpo run)")
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy to reach (default 0.9)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="trainer.seed of each triple of runs")
    parser.add_argument("--test-freq", type=int, default=5, help="validate every this many steps (the demo: 10)")
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "hf")
    parser.add_argument("--distill", nargs="+", default=[], metavar="KEY=VALUE",
                        help="algorithm.distill keys of both distillation runs, e.g. mode=loss "
                             "estimator=forward_kl_topk topk=4 (default: mode=advantage, k1, discount 0)")
    parser.add_argument("--out", help="keep the runs here (the trained teacher: OUT/grpo-SEED/checkpoints/latest)")
    parser.add_argument("--quick", action="store_true", help="30 steps a run: checks the script, measures nothing")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    from vlmrl.config import load_config

    demo = ROOT / "examples" / "configs" / "tiny_synthetic.yaml"
    budget = 30 if args.quick else load_config([f"config={demo}"]).trainer.total_steps
    common = [f"config={demo}", f"rollout.name={args.backend}", f"trainer.total_steps={budget}",
              f"trainer.test_freq={args.test_freq}", "trainer.save_freq=-1"]
    results: dict[int, dict[str, dict]] = {}
    teacher = args.teacher
    distill_keys = [f"algorithm.distill.{setting}" for setting in args.distill]
    with tempfile.TemporaryDirectory(prefix="vlmrl-bench-distill-") as scratch:
        tmp = args.out or scratch
        for seed in args.seeds:
            results[seed] = {}
            for name, extra in RUNS.items():
                out = Path(tmp) / f"{name}-{seed}"
                if name == "grpo" and teacher is None:  # the demo to its end: the teacher of every distillation run
                    results[seed][name] = r = train([*common, f"trainer.seed={seed}", f"trainer.save_freq={budget}"],
                                                    out, args.target, False)
                    teacher = str(out / "checkpoints" / "latest")
                    print(f"seed {seed} grpo: {r['steps'] or 'not reached'}; trained on to step {r['curve'][-1][0]} "
                          f"(val accuracy {r['curve'][-1][1]:.2f}) as the teacher ({r['seconds']:.0f} s)", flush=True)
                    continue
                distill = [f"algorithm.distill.teacher={teacher}", *distill_keys] if name != "grpo" else []
                results[seed][name] = r = train([*common, f"trainer.seed={seed}", *distill, *extra], out, args.target,
                                                True)
                print(f"seed {seed} {name}: {r['steps'] or 'not reached'} ({r['seconds']:.0f} s)", flush=True)
    print(f"\nsteps to val accuracy {args.target} (budget {budget} steps after the {args.backend} demo's warm-up; "
          f"validated every {args.test_freq}; distillation: {' '.join(args.distill) or 'the defaults'})")
    print(f"{'seed':>4}  {'grpo':>6}  {'distill':>8}  {'distill+reward':>14}  {'grpo/distill':>12}  "
          f"{'grpo/distill+reward':>19}")
    for seed, runs in results.items():
        steps = {name: runs[name]["steps"] for name in RUNS}

        def ratio(name: str) -> str:
            grpo, other = steps["grpo"], steps[name]
            return f"{grpo / other:.2f}x" if grpo and other else "-"

        counts = "  ".join(f"{steps[name] or '-':>{width}}" for name, width in (("grpo", 6), ("distill", 8),
                                                                                   ("distill+reward", 14)))
        print(f"{seed:>4}  {counts}  {ratio('distill'):>12}  {ratio('distill+reward'):>19}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "budget": budget, "results": results}, indent=1)
                                   + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
