"""LoRA vs full fine-tuning on the embedded tiny-large Qwen2.5-VL: weight-sync time and bytes per sync for each path,
and the trainer's peak memory for one update step, as ratios in the same run.

    .venv/bin/python benchmarks/bench_lora.py                      # rank 64, vLLM + SGLang, 3 syncs each
    .venv/bin/python benchmarks/bench_lora.py --rank 8 --backends vllm --syncs 5

Sync rows (each one started engine, synced `--syncs` times after a step that moves every trainable weight, the
median time, the most the process's RSS grew during a sync and the most merged LoRA weights alive at once reported;
`--bucket-mb` sets rollout.sync_bucket_mb):
full fine-tuning into vLLM (every weight); LoRA merged into vLLM (every weight: vLLM reloads
whole layers); LoRA adapter into vLLM (enable_lora: the adapter file only); LoRA merged into SGLang (the adapted
layers only: a partial update). After each sync the engine's greedy output on 4 image requests is checked against
transformers on the actor's (merged) weights: a row that differs says MISMATCH instead of a time.

Memory: one process per side (full, LoRA) builds the actor and runs two PPO updates of 16 samples; reported: the
peak RSS during the updates (sampled every 2 ms), what it grew by over the RSS just before them (the training state:
gradients, AdamW moments, activations), and the trainable parameters. `--backends none` measures memory only. Writes JSON (atomically) with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import torch  # noqa: E402

from vlmrl.actor.local import Actor  # noqa: E402
from vlmrl.atomic import write_text_atomically  # noqa: E402
from vlmrl.config import ActorConfig, LoraConfig, OptimConfig  # noqa: E402
from vlmrl.models.tiny import ensure_built  # noqa: E402
from vlmrl.types import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def actor(model: str, rank: int) -> Actor:
    lora = LoraConfig(rank=rank, alpha=rank) if rank else LoraConfig()
    config = ActorConfig(model_path=model, device="cpu", optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=4,
                         lora=lora)
    return Actor(config, total_steps=1, mini_batch_samples=16)


def perturb(policy: Actor, seed: int) -> None:
    """Move every trainable weight (a stand-in for a training step; LoRA's B leaves 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable:
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def requests(model: str) -> list:
    import numpy as np
    from PIL import Image

    from vlmrl.processors.loading import load_processor

    processor = load_processor(model)
    rows = []
    for i in range(4):
        pixels = np.random.default_rng(i).integers(0, 256, size=(112, 112, 3), dtype=np.uint8)
        rows.append({"data_source": "bench", "prompt": [{"role": "user", "content": "<image>What is it?"}],
                     "images": [Image.fromarray(pixels, mode="RGB")]})
    return [processor.build_request(row, index=i) for i, row in enumerate(rows)]


class PeakRss:
    """The most this process's RSS grew over its value at the start of the block (sampled every 2 ms; ru_maxrss
    cannot be reset)."""

    def __enter__(self) -> PeakRss:
        self.process = psutil.Process()
        self.start = self.process.memory_info().rss
        self.peak, self.done = self.start, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.grew_mib = (max(self.peak, self.process.memory_info().rss) - self.start) / 2**20


class MergedAlive:
    """The most bytes of merged LoRA weights (base + scaled B @ A, `vlmrl.actor.lora.merge_weight`'s results) alive at
    once during the block: what a merged sync holds on the trainer's side, free of the allocator's noise in RSS. A
    stream in buckets holds about one bucket; a materialised merged model holds every adapted layer."""

    def __enter__(self) -> MergedAlive:
        import weakref

        import vlmrl.actor.lora as lora

        self.module, self.merge = lora, lora.merge_weight
        self.now = self.peak = 0

        def tracked(*args):
            merged = self.merge(*args)
            size = merged.numel() * merged.element_size()
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(merged, self._freed, size)
            return merged

        lora.merge_weight = tracked
        return self

    def _freed(self, size: int) -> None:
        self.now -= size

    def __exit__(self, *exc) -> None:
        self.module.merge_weight = self.merge


def sync_row(name: str, policy: Actor, backend: str, model: str, syncs: int, reference, **options) -> dict:
    from vlmrl.rollout.registry import get_backend

    batch = requests(model)
    times, grew, alive, sent, exact = [], [], [], 0, True
    with get_backend(backend, model, dtype="float32", max_model_len=1024, timeout_s=900, **options) as engine:
        for k in range(syncs):
            perturb(policy, seed=k)
            start = time.perf_counter()
            with PeakRss() as rss, MergedAlive() as merged:
                policy.sync_weights(engine)
            times.append(time.perf_counter() - start)
            grew.append(rss.grew_mib)
            alive.append(merged.peak / 2**20)
            sent = policy.last_sync_bytes
            reference.update_weights(list(policy.named_tensors()))
            exact &= ([r.response_ids for r in engine.generate(batch, GREEDY)]
                      == [r.response_ids for r in reference.generate(batch, GREEDY)])
    return {"row": name, "backend": backend, "sync_s": statistics.median(times), "bytes": sent,
            "rss_growth_mib": max(grew), "merged_alive_mib": max(alive), "bucket_mb": engine.rollout.sync_bucket_mb,
            "path": policy.lora_sync.path(engine) if policy.lora_sync else "full", "equal_to_hf": exact}


def memory_side(model: str, rank: int) -> dict:
    """One update step in this process; returns its peak RSS and trainable parameters."""
    import tempfile

    from tests.batches import make_batch, synthetic_rows
    from vlmrl.algorithms.grpo import group_advantages
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    rows = synthetic_rows(tempfile.mkdtemp(), train_size=8, val_size=2)
    processor = load_processor(model, DataConfig(max_prompt_length=64))
    batch = make_batch(processor, rows[:8], n=2, response_length=32)
    policy = actor(model, rank)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    process = psutil.Process()
    before = process.memory_info().rss
    peak, done = [before], threading.Event()

    def sample() -> None:  # RSS every 2 ms while the update runs (ru_maxrss cannot be reset after loading)
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(2):  # the second step has AdamW's moments in place
        policy.update(batch, None, advantages)
    done.set()
    sampler.join()
    return {"rank": rank, "peak_rss_mib": peak[0] / 2**20, "training_mib": (peak[0] - before) / 2**20,
            "trainable": sum(p.numel() for p in policy.trainable)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-large")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["vllm", "sglang"])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="rollout.sync_bucket_mb for every engine (default: the option's default)")
    parser.add_argument("--out", default="")
    parser.add_argument("--memory-side", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from vlmrl.rollout.config import RolloutConfig, VLLMConfig
    from vlmrl.rollout.registry import cpu_env

    for name in args.backends:  # what each engine sets for itself on a CPU (none on a GPU), vLLM's KV cache at 2 GiB
        os.environ.update(cpu_env(RolloutConfig(vllm=VLLMConfig(cpu_kv_cache_gb=2)), name))
    model = str(ensure_built(args.model))
    if args.memory_side >= 0:
        print(json.dumps(memory_side(model, args.memory_side)))
        return
    from vlmrl.rollout.registry import get_backend

    result: dict = {"model": args.model, "rank": args.rank, "sync": [], "memory": []}
    bucket = {} if args.bucket_mb is None else {"sync_bucket_mb": args.bucket_mb}
    with get_backend("hf", model, dtype="float32", max_model_len=1024, timeout_s=900) as reference:
        full, lora = actor(model, 0), actor(model, args.rank)
        if "vllm" in args.backends:
            result["sync"].append(sync_row("full fine-tuning", full, "vllm", model, args.syncs, reference, **bucket))
            lora.config.lora.sync = "merged"
            result["sync"].append(sync_row("LoRA merged", lora, "vllm", model, args.syncs, reference, **bucket))
            lora.config.lora.sync = "auto"
            result["sync"].append(sync_row("LoRA adapter", lora, "vllm", model, args.syncs, reference,
                                           lora_rank=args.rank))
        if "sglang" in args.backends:
            result["sync"].append(sync_row("full fine-tuning", full, "sglang", model, args.syncs, reference, **bucket))
            result["sync"].append(sync_row("LoRA merged (partial)", lora, "sglang", model, args.syncs, reference,
                                           **bucket))
    for rank in (0, args.rank):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--memory-side", str(rank)],
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        result["memory"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    full_sync = {r["backend"]: r for r in result["sync"] if r["row"] == "full fine-tuning"}
    print(f"{args.model}, LoRA rank {args.rank}")
    print(f"{'sync':28} {'backend':8} {'path':8} {'s/sync':>8} {'MB/sync':>9} {'vs full':>8} {'RSS+ MiB':>9} "
          f"{'merged MiB':>10} {'bucket MiB':>10}  equal to hf")
    for r in result["sync"]:
        base = full_sync[r["backend"]]
        print(f"{r['row']:28} {r['backend']:8} {r['path']:8} {r['sync_s']:8.3f} {r['bytes'] / 1e6:9.2f} "
              f"{r['bytes'] / base['bytes']:8.4f} {r['rss_growth_mib']:9.1f} {r['merged_alive_mib']:10.1f} "
              f"{r['bucket_mb']:10g}  "
              f"{'yes' if r['equal_to_hf'] else 'MISMATCH'}")
    full_mem, lora_mem = result["memory"]
    for m in result["memory"]:
        print(f"memory rank {m['rank']:3}: peak RSS {m['peak_rss_mib']:8.1f} MiB, training state "
              f"{m['training_mib']:7.1f} MiB, trainable {m['trainable'] / 1e6:.3f}M")
    print(f"peak RSS ratio LoRA/full {lora_mem['peak_rss_mib'] / full_mem['peak_rss_mib']:.3f}; training state "
          f"ratio {lora_mem['training_mib'] / max(full_mem['training_mib'], 1e-9):.3f}")
    if args.out:
        write_text_atomically(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
