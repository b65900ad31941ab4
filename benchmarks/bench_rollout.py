"""Rollout throughput: generated tokens/s of every backend at n=8, as a ratio to the `hf` reference, in one run.

    .venv/bin/python benchmarks/bench_rollout.py                     # models tiny and tiny-large, all backends
    .venv/bin/python benchmarks/bench_rollout.py --models tiny-large --backends hf vllm --requests 16
    python benchmarks/bench_rollout.py --models tiny-large --dtype bfloat16 \
        --engine-kwargs 'vllm={"attention_backend": "TRITON_ATTN"}'      # on a GPU; engine arguments per backend

The same requests (built by vlmrl.processors: a quarter text-only, half with one image, a quarter with two; with
`--workloads video`, one 4-frame 112x112 video each, the synthetic motion task's rows sampled at 24 fps, the rate
SGLang reads frames at; sglang-server takes no video) go to each backend in turn; one backend is alive at a time. Per backend: start (timed apart), one warm-up call, then
`--repeats` timed calls of all requests x n samples; reported: the median call's generated tokens / seconds.
Before timing, every backend's greedy output on the requests is checked against hf's: in float32 a backend that
does not reproduce hf token for token is reported as MISMATCH instead of a speed; in bfloat16 (where greedy outputs
part at near-ties) the check is only shown. Writes JSON (atomically) with --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass

# One torch/OpenMP thread per process unless OMP_NUM_THREADS says otherwise: set before torch is imported, and
# inherited by the engines' own processes. On a small shared CPU, multi-threaded OpenMP spin-waits against other
# jobs (measured: SGLang's call on tiny-large took 9 s one run and 95 s the next at the default 2 threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from vlmrl.models.tiny import ensure_built  # noqa: E402
from vlmrl.processors.loading import load_processor  # noqa: E402
from vlmrl.rollout.config import RolloutConfig, VLLMConfig  # noqa: E402
from vlmrl.rollout.registry import cpu_env, get_backend  # noqa: E402
from vlmrl.types import SamplingParams  # noqa: E402

BACKENDS = ["hf", "vllm", "sglang", "sglang-server"]


@dataclass
class Row:
    model: str
    workload: str
    backend: str
    start_s: float
    call_s: float
    tokens: int
    tokens_per_s: float
    greedy_matches_hf: bool
    ratio_to_hf: float | None = None


def build_requests(model_path: str, count: int, workload: str = "images") -> list:
    """`count` requests from verl-style rows: 1/4 text-only, 1/2 one image, 1/4 two images, varied sizes; or
    (workload "video") one video each."""
    if workload == "video":
        from vlmrl.data.config import DataConfig
        from vlmrl.data.synthetic import generate_rows

        processor = load_processor(model_path, DataConfig(video_fps=24.0, max_prompt_length=2048))
        return [processor.build_request(row, index=i) for i, row in enumerate(generate_rows("motion", count, 0, "val"))]
    processor = load_processor(model_path)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        images = [] if i % 4 == 0 else [None] * (2 if i % 4 == 3 else 1)
        pictures = [Image.fromarray(rng.integers(0, 256, (int(rng.integers(80, 400)), int(rng.integers(80, 400)), 3),
                                                 dtype=np.uint8)) for _ in images]
        text = "".join("<image>" for _ in images) + f"Question {i}: describe what you see in detail."
        rows.append({"prompt": [{"role": "user", "content": text}], "images": pictures})
    return [processor.build_request(row, index=i) for i, row in enumerate(rows)]


def measure(name: str, model: str, model_path: str, requests, sampling: SamplingParams, repeats: int,
            reference: list | None, dtype: str, engine_kwargs: dict, workload: str = "images") -> tuple[Row, list]:
    t0 = time.perf_counter()
    with get_backend(name, model_path, dtype=dtype, max_model_len=2048, timeout_s=1800,
                     start_timeout_s=1800, engine_kwargs=engine_kwargs) as backend:
        start = time.perf_counter() - t0
        greedy = backend.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=16))
        matches = reference is None or [r.response_ids for r in greedy] == [r.response_ids for r in reference]
        backend.generate(requests, sampling)  # warm-up
        timings = []
        for _ in range(repeats):
            t = time.perf_counter()
            results = backend.generate(requests, sampling)
            timings.append((time.perf_counter() - t, sum(len(r.response_ids) for r in results)))
    call_s, tokens = sorted(timings)[len(timings) // 2]
    row = Row(model, workload, name, round(start, 1), round(call_s, 3), tokens, round(tokens / call_s, 1), matches)
    print(f"  {model:10s} {workload:7s} {name:14s} start {start:6.1f} s  call {call_s:7.3f} s  {tokens:6d} tokens  "
          f"{tokens / call_s:9.1f} tok/s  greedy==hf: {matches}", flush=True)
    return row, greedy


def device_name() -> str:
    import torch

    return f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"


def parse_engine_kwargs(items: list[str]) -> dict[str, dict]:
    """{"vllm": {...}} from ["vllm={...}"]: each backend's extra engine arguments (its `engine_kwargs` option)."""
    parsed: dict[str, dict] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in BACKENDS:
            raise SystemExit(f"--engine-kwargs {item!r}: expected BACKEND=JSON with BACKEND one of {BACKENDS}")
        value = json.loads(text)
        if not isinstance(value, dict):
            raise SystemExit(f"--engine-kwargs {item!r}: the JSON must be an object")
        parsed.setdefault(name, {}).update(value)
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "tiny-large"])
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--workloads", nargs="+", default=["images"], choices=["images", "video"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engine-kwargs", nargs="*", default=[], metavar="BACKEND=JSON",
                        help="extra engine arguments of one backend, e.g. "
                             'vllm=\'{"attention_backend": "TRITON_ATTN"}\'')
    parser.add_argument("--out", default="", help="write the rows as JSON here (atomically)")
    args = parser.parse_args()
    for name in ('requests', 'n', 'max_new_tokens', 'repeats'):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    engine_kwargs = parse_engine_kwargs(args.engine_kwargs)
    logging.basicConfig(level=logging.WARNING)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    rows: list[Row] = []
    backends = ["hf"] + [b for b in args.backends if b != "hf"]  # hf first: the reference and the ratio's base
    for name in backends:  # what each engine sets for itself on a CPU (none on a GPU), vLLM's KV cache at 2 GiB
        os.environ.update(cpu_env(RolloutConfig(vllm=VLLMConfig(cpu_kv_cache_gb=2)), name))
    print(f"{args.requests} requests x n={args.n}, up to {args.max_new_tokens} new tokens, temperature 1.0, "
          f"{args.dtype}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs; {device_name()}")
    for model in args.models:
        path = str(ensure_built(model))
        for workload in args.workloads:
            requests = build_requests(path, args.requests, workload)
            reference = None
            for name in backends:
                if workload == "video" and name == "sglang-server":
                    print(f"  {model:10s} {workload:7s} {name:14s} skipped: the server takes no video here")
                    continue
                row, greedy = measure(name, model, path, requests, sampling, args.repeats, reference, args.dtype,
                                      engine_kwargs.get(name, {}), workload)
                reference = greedy if name == "hf" else reference
                rows.append(row)
            base = next(r.tokens_per_s for r in rows
                        if r.model == model and r.workload == workload and r.backend == "hf")
            for r in rows:
                if r.model == model and r.workload == workload:
                    r.ratio_to_hf = round(r.tokens_per_s / base, 2)
    print("\n| model | workload | backend | start s | tokens/s | ratio to hf | greedy == hf |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r.tokens_per_s:.0f}" if r.greedy_matches_hf or args.dtype != "float32" else "MISMATCH"
        print(f"| {r.model} | {r.workload} | {r.backend} | {r.start_s} | {speed} | {r.ratio_to_hf}x | "
              f"{r.greedy_matches_hf} |")
    print(f"(load average {os.getloadavg()[0]:.1f} at the end)")
    if args.out:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        with tempfile.NamedTemporaryFile("w", dir=out_dir, delete=False, suffix=".tmp") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=1)
        os.replace(f.name, args.out)


if __name__ == "__main__":
    main()
