"""The figures of docs/alignment.md's "Is the trainer computing what the engine sampled?": the trainer against each
engine on the demo's model and validation set, with the engines in float32 and in bfloat16.

    .venv/bin/python scripts/trainer_vs_engines.py [--rows 32] [--out outputs/trainer-vs-engines] [key=value ...]

Runs `python -m vlmrl.alignment.compare --backends X,trainer` (the engine validates, then the trainer scores its
samples teacher-forced) for X in vllm, sglang and rollout.dtype in float32, bfloat16, one after another, and prints
one markdown row per run from its report.json. Extra key=value overrides go to every run (e.g. the model:
actor.model_path=outputs/demo/checkpoints/latest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--out", default="outputs/trainer-vs-engines")
    parser.add_argument("--engines", default="vllm,sglang")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from vlmrl.rollout.config import RolloutConfig
    from vlmrl.rollout.registry import cpu_env

    rows = ["| engine | engine dtype | samples | exact | precision (band) | other causes | max abs dlogp "
            "| mean abs dlogp | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for engine in args.engines.split(","):
        for dtype in ("float32", "bfloat16"):
            out = Path(args.out) / f"{engine}-{dtype}"
            command = [sys.executable, "-m", "vlmrl.alignment.compare", "--backends", f"{engine},trainer",
                       f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}",
                       f"data.synthetic_val_size={args.rows}", f"rollout.dtype={dtype}",
                       f"trainer.output_dir={out / 'runs'}", *args.overrides, "--out", str(out), "--no-html"]
            env = {**os.environ, **cpu_env(RolloutConfig(), engine)}  # what the engine sets for itself on a CPU
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode not in (0, 1):
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            report = json.loads((out / "report.json").read_text())
            summary = report["summary"]
            causes = {k: v for k, v in summary["causes"].items() if v}
            precision = causes.pop("precision", 0)
            other = ", ".join(f"{k} {v}" for k, v in causes.items()) or "none"
            rows.append(f"| {engine} | {dtype} | {summary['samples']} | {summary['exact']} | {precision} | {other} | "
                        f"{summary['max_abs_logprob_delta']:.2g} | {summary['mean_abs_logprob_delta']:.2g} | "
                        f"{'aligned' if report['ok'] else 'NOT ALIGNED'} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
