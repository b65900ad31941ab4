"""Peak resident memory of a training rank during weight sync: bucketed (rollout.sync_bucket_mb) vs one bucket
(sync_bucket_mb = 0: what main did, the whole model gathered to the host, then serialised in one blob), side by side
in one run, on tiny-large (~50 M parameters) sharded over dp = 2 Ray workers (FSDP2, gloo, CPU), each with a
colocated vLLM engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0: in-process, so the engine's copies show
in the rank's RSS as they would on one host).

For each side the driver starts the workers, syncs once (warm-up: first-call allocations), then samples every
worker's RSS each millisecond (psutil, by pid) during a second sync and reports the peak above the RSS before it,
and the sync's wall time. (That the bucketed sync lands the same weights is the tests' job: the engine contract's
bucketed sync test and the dp = 2 colocated-engine test.)

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/bench_weight_sync.py
        # --model tiny-large --buckets 0 16 64 --dtype float32
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import threading
import time

import psutil
import torch


class PeakRss:
    """Samples the RSS of some processes every millisecond; `peaks` is each one's most above its start."""

    def __init__(self, pids: list[int]):
        self.processes = [psutil.Process(pid) for pid in pids]
        self.peaks = [0] * len(pids)
        self._stop = threading.Event()

    def __enter__(self):
        self.start = [p.memory_info().rss for p in self.processes]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            for i, p in enumerate(self.processes):
                self.peaks[i] = max(self.peaks[i], p.memory_info().rss - self.start[i])
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def model_bytes(model_path: str, dtype: torch.dtype) -> int:
    from safetensors import safe_open

    from vlmrl.models.tiny import resolve_model_path

    total = 0
    path = resolve_model_path(model_path)
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total * torch.tensor([], dtype=dtype).element_size()


def run_side(model_path: str, bucket_mb: float, dtype: str) -> dict:
    import ray

    from vlmrl.actor.config import ActorConfig
    from vlmrl.distributed.group import ClusterSpec, DistributedActor
    from vlmrl.distributed.worker import EngineSpec, WorkerSpec
    from vlmrl.rollout.base import BackendOptions

    engine = EngineSpec("vllm", model_path, BackendOptions.from_kwargs("vllm", {
        "dtype": dtype, "max_model_len": 256, "timeout_s": 600, "sync_bucket_mb": bucket_mb}))
    config = ActorConfig(model_path=model_path, device="cpu", dtype="float32", ppo_micro_batch_size_per_gpu=1)
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2, engine_placement="worker"),
                             WorkerSpec(actor=config, engine=engine, torch_threads=1, timeout_s=600),
                             mini_batch_samples=2, timeout_s=900)
    try:
        pids = ray.get([w.__ray_call__.remote(lambda worker: os.getpid()) for w in actor.workers])
        actor.sync_weights(None)  # warm-up
        with PeakRss(pids) as rss:
            start = time.perf_counter()
            actor.sync_weights(None)
            seconds = time.perf_counter() - start
        return {"peaks": rss.peaks, "seconds": seconds}
    finally:
        actor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-large")
    parser.add_argument("--buckets", type=float, nargs="+", default=[0, 16, 64])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vlmrl-ray-"),
             log_to_driver=False)
    size = model_bytes(args.model, getattr(torch, args.dtype))
    print(f"{args.model}: {size / 2**20:.0f} MiB in the engine dtype ({args.dtype}); dp = 2, vLLM in-process")
    print("| sync_bucket_mb | peak RSS above start, rank 0 / rank 1 | x model size | sync time |")
    print("|---|---|---|---|")
    for bucket in args.buckets:
        r = run_side(args.model, bucket, args.dtype)
        peak = max(r["peaks"])
        label = "0 (one bucket: main's behaviour)" if bucket == 0 else f"{bucket:g}"
        print(f"| {label} | {r['peaks'][0] / 2**20:.0f} / {r['peaks'][1] / 2**20:.0f} MiB | {peak / size:.2f}x | "
              f"{r['seconds']:.2f} s |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
