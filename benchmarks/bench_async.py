"""Samples trained on per second: the asynchronous placement (trainer.async_rollout) vs the synchronous loop, side
by side on the demo (examples/configs/tiny_synthetic.yaml: vLLM, 16 prompts x 8 samples).

    .venv/bin/python benchmarks/bench_async.py [--steps 30] [--backend vllm] [--max-staleness 1] [--long-tail]
                                               [--pin] [--workers N] [--correction token_tis]
                                               [--sync-correction off] [--staged] [--probe-tokens 0]

Both runs do the demo's format warm-up (seeded: the same in both) and use the same seeds and settings; only the
placement differs. The rate is samples trained on per second over steps 3..N
(engine start, warm-up and the first batches left out), timed at each step's log line. --long-tail: responses up to
48 tokens instead of the demo's 6, with no format warm-up, so a step's rollout is longer than its update (the
random-init model ends a response at a random point: long-tailed lengths). The async run's staleness histogram and
the mismatch it trains with are printed next to the ratio. The trainer runs at `trainer.torch_threads=1`, so on 2
CPU cores the engine's thread can take the other core. --workers N: the async run's engine in N rollout workers
(trainer.async_rollout.rollout_workers, Ray actors: processes of their own); with --pin their processes go on core
1, the trainer on core 0. --correction: the algorithm.rollout_correction of both runs (default token_tis, which
recomputes the old logprobs: one forward pass more a step); --sync-correction: another one for the synchronous run
(the demo's own is off). `bypass` (verl's bypass mode) anchors the update on the engine's logprobs with no
recomputing pass. --staged: the async run's trainer stages its weights after each update and goes on
(trainer.async_rollout.staged_sync): the rollout thread loads them before its next batch; with this benchmark's
settings (no validation, no checkpoints) only the last step waits for its sync and probes it, where the synchronous
run probes every sync: --probe-tokens 0 (trainer.weight_probe_tokens, both runs) takes the probe out of both.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(overrides: list[str], out: Path, first_timed: int) -> dict:
    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit
    from vlmrl.trainer.metrics import read_metrics

    stamps: dict[int, float] = {}

    def stamp(step: int, metrics: dict) -> bool:
        stamps[step] = time.perf_counter()
        return False

    fit(load_config([*overrides, f"trainer.output_dir={out}"]), stop=stamp)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    last = max(stamps)
    samples = sum(r["batch/real_rows"] for r in rows if first_timed < r["step"] <= last)
    seconds = stamps[last] - stamps[first_timed]
    staleness = collections.Counter(int(r.get("async/staleness", 0)) for r in rows)
    return {"samples_per_s": samples / seconds, "seconds": seconds, "samples": samples,
            "staleness": dict(sorted(staleness.items())),
            "k3_mean": sum(r.get("mismatch/k3", 0.0) for r in rows) / len(rows),
            "rollout_s": sum(r["timing/rollout"] for r in rows) / len(rows),
            "update_s": sum(r["timing/update"] for r in rows) / len(rows),
            **{f"{key.split('/')[-1]}_s": sum(r.get(key, 0.0) for r in rows) / len(rows)
               for key in ("timing/weight_sync", "timing/weight_probe", "async/trainer_wait_s", "timing/step")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--long-tail", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--pin", action="store_true", help="trainer on core 0, the engine's threads on core 1 "
                        "(VLLM_CPU_OMP_THREADS_BIND=1; needs VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    parser.add_argument("--workers", type=int, default=0, help="the async run's engine in this many rollout workers")
    parser.add_argument("--correction", default="token_tis", help="algorithm.rollout_correction of both runs")
    parser.add_argument("--sync-correction", help="algorithm.rollout_correction of the synchronous run")
    parser.add_argument("--staged", action="store_true", help="the async run with trainer.async_rollout.staged_sync")
    parser.add_argument("--probe-tokens", type=int, help="trainer.weight_probe_tokens of both runs (default the "
                        "demo's)")
    args = parser.parse_args()
    from vlmrl.rollout.config import RolloutConfig
    from vlmrl.rollout.registry import cpu_env

    os.environ.update(cpu_env(RolloutConfig(), args.backend))  # what the engine sets for itself on a CPU (none on a GPU)
    if args.pin:  # every thread of the engine's processes on core 1, the trainer's on core 0
        import psutil

        import vlmrl.distributed.rollout_workers as workers_module
        import vlmrl.trainer.fit as fit_module

        def pin(pids: list[int]) -> None:
            engines = [psutil.Process(pid) for pid in pids]
            engines += [child for p in engines for child in p.children(recursive=True)]
            if not engines:
                raise SystemExit("--pin needs the engine in processes of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1, "
                                 "--backend sglang-server, or --workers 1)")
            for process in engines:
                for thread in process.threads():
                    os.sched_setaffinity(thread.id, {1})
            os.sched_setaffinity(0, {0})  # this thread (the trainer) and the threads it starts later: core 0

        start = fit_module.start_run_backend

        def start_then_pin(*a, **k):
            backend = start(*a, **k)
            pin(backend.engine_pids)
            return backend

        class PinnedWorkers(workers_module.RemoteEngines):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                pin(self.worker_pids)

        fit_module.start_run_backend = start_then_pin
        workers_module.RemoteEngines = PinnedWorkers
    config = ROOT / "examples" / "configs" / "tiny_synthetic.yaml"
    common = [f"config={config}", f"rollout.name={args.backend}", f"trainer.total_steps={args.steps}",
              "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
              "trainer.torch_threads=1"]
    if args.probe_tokens is not None:
        common.append(f"trainer.weight_probe_tokens={args.probe_tokens}")
    if args.long_tail:
        common += ["data.max_response_length=48", "trainer.format_warmup_steps=0"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="vlmrl-bench-async-") as tmp:
        placement = ["trainer.async_rollout.enable=true", f"trainer.async_rollout.max_staleness={args.max_staleness}",
                     f"trainer.async_rollout.rollout_workers={args.workers}",
                     f"algorithm.rollout_correction={args.correction}",
                     f"trainer.async_rollout.staged_sync={str(args.staged).lower()}"]
        synchronous = [f"algorithm.rollout_correction={args.sync_correction or args.correction}"]
        for name, extra in (("sync", synchronous), ("async", placement)):
            results[name] = run([*common, *extra], Path(tmp) / name, first_timed=2)
            r = results[name]
            print(f"{name:5s}: {r['samples_per_s']:.1f} samples/s ({r['samples']} samples in {r['seconds']:.1f} s; "
                  f"rollout {r['rollout_s']:.3f} s, update {r['update_s']:.3f} s, sync {r['weight_sync_s']:.3f} s, probe "
                  f"{r['weight_probe_s']:.3f} s, step {r['step_s']:.3f} s); staleness {r['staleness']}; "
                  f"mean mismatch/k3 {r['k3_mean']:.3g}", flush=True)
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async / sync: {ratio:.2f}x samples trained on per second ({args.backend}, {args.steps} steps, "
          f"max_staleness {args.max_staleness}{', long-tailed responses' if args.long_tail else ''}"
          f"{f', {args.workers} rollout worker(s)' if args.workers else ''}; correction {args.correction}"
          f"{f', synchronous {args.sync_correction}' if args.sync_correction else ''}"
          f"{'; staged syncs' if args.staged else ''}"
          f"{f'; weight_probe_tokens {args.probe_tokens}' if args.probe_tokens is not None else ''})")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio": ratio, **results, "args": vars(args)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
