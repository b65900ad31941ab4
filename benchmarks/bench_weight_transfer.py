"""A weight sync into rollout workers: through Ray's object store vs through the collective group (gloo on CPU), side
by side in one run on the same weights, into the same worker's engine (trainer.async_rollout.weight_transfer).

For each model the driver starts one rollout worker (a Ray actor, its engine in float32), holds the model's float32
weights (a trainer's master weights), syncs once each way (warm-up), then for `--repeats` rounds times a sync each way
and samples, each millisecond, the driver's RSS (psutil) and the object store's use (Ray's own accounting of the
bytes stored). Reported per way: the sync's median seconds, the driver's peak RSS above its level before the sync, and
the object store's bytes held after it (the object store path keeps the last sync there for a restart). After each
way the engine's weights checksum (`RolloutBackend.weights_checksum`: the engine's own parameters, hashed) must equal
the other way's: the two transfers land the same weights, bit for bit, or the script exits with MISMATCH.

Models: the embedded tiny-large (~50 M parameters) and `random-<N>m`, a Qwen2.5-VL of about N million parameters
with random weights, built once into a temp folder with the tiny builder's vision tower and tokenizer.

    .venv/bin/python benchmarks/bench_weight_transfer.py            # --models tiny-large random-300m --engine vllm

`--dp2`: the sender instead, at dp = 2 (two FSDP2 training workers, float32, beside one rollout worker, both ways
over the collective group): the whole weights gathered to the driver and broadcast from it (how a dp > 1 run synced
before training rank 0 sent them) vs training rank 0 broadcasting each bucket as the ranks gather it
(`RemoteEngines.sync_from_ranks`). Same report: seconds, the driver's peak RSS, and the engine's checksums equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_logprobs_memory import RssPeak  # the driver's RSS above its start, sampled every millisecond


def object_store_bytes() -> int:
    """Bytes the cluster's object stores hold now (Ray's accounting: total minus available)."""
    import ray

    total, free = ray.cluster_resources().get("object_store_memory", 0), ray.available_resources().get(
        "object_store_memory", 0)
    return int(total - free)


def random_model(millions: int, folder: Path) -> str:
    """A Qwen2.5-VL of about `millions` M parameters, random weights (seeded), tiny-large's vision tower."""
    from dataclasses import replace

    from vlmrl.models.tiny.common import VOCAB_SIZE
    from vlmrl.models.tiny.qwen2_5_vl import SPECS, build

    hidden = 1536  # 12 heads of 128, tiny-large's rope sections
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden
    layers = max(1, round((millions * 1e6 - 2 * VOCAB_SIZE * hidden) / per_layer))
    spec = replace(SPECS["tiny-large"], text_hidden=hidden, text_layers=layers, text_heads=12,
                   text_intermediate=4 * hidden)
    out = folder / f"random-{millions}m"
    if not (out / "config.json").exists():
        build(out, spec)
    return str(out)


def measure(model: str, engine: str, repeats: int, bucket_mb: float) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.distributed.rollout_actor import RolloutWorkerSpec
    from vlmrl.distributed.rollout_workers import RemoteEngines
    from vlmrl.distributed.worker import EngineSpec
    from vlmrl.models.tiny import resolve_model_path
    from vlmrl.rollout.base import BackendOptions

    path = resolve_model_path(model)
    options = BackendOptions.from_kwargs(engine, {"dtype": "float32", "max_model_len": 1024, "timeout_s": 600,
                                                  "sync_bucket_mb": bucket_mb})
    weights = [(k, v.detach()) for k, v in
               AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict().items()]
    size = sum(t.numel() * t.element_size() for _, t in weights)
    engines = RemoteEngines(RolloutWorkerSpec(EngineSpec(engine, path, options), weight_transfer="collective"),
                            workers=1)
    out = {"model": model, "params_m": sum(t.numel() for _, t in weights) / 1e6, "mib": size / 2**20}
    try:
        sums = {}
        for way in ("collective", "object_store"):
            engines.transfer = way
            engines.update_weights(weights)  # warm-up
            seconds, peaks, stored = [], [], []
            for _ in range(repeats):
                with RssPeak() as rss:
                    begin = time.perf_counter()
                    engines.update_weights(weights)
                    seconds.append(time.perf_counter() - begin)
                peaks.append(rss.peak)
                stored.append(object_store_bytes())
            sums[way] = engines.weights_checksums()
            out[way] = {"s": statistics.median(seconds), "rss_mib": max(peaks) / 2**20,
                        "store_mib": max(stored) / 2**20}
            engines._last_sync = None  # what the object store path keeps, freed before the other way runs
        out["same_weights"] = sums["collective"] == sums["object_store"]
    finally:
        engines.close()
    return out


def measure_senders(model: str, engine: str, repeats: int, bucket_mb: float) -> dict:
    """dp = 2 training workers and one rollout worker: a collective sync sent by the driver (the weights gathered to
    it first) vs by training rank 0, timed and the driver's RSS sampled, as `measure`."""
    from vlmrl.actor.config import ActorConfig
    from vlmrl.distributed.group import ClusterSpec, DistributedActor
    from vlmrl.distributed.rollout_actor import RolloutWorkerSpec
    from vlmrl.distributed.rollout_workers import RemoteEngines
    from vlmrl.distributed.worker import EngineSpec, WorkerSpec
    from vlmrl.models.tiny import resolve_model_path
    from vlmrl.rollout.base import BackendOptions

    path = resolve_model_path(model)
    options = BackendOptions.from_kwargs(engine, {"dtype": "float32", "max_model_len": 1024, "timeout_s": 600,
                                                  "sync_bucket_mb": bucket_mb})
    actor = DistributedActor(ClusterSpec(n_gpus_per_node=2),
                             WorkerSpec(actor=ActorConfig(model_path=path, device="cpu", dtype="float32"),
                                        torch_threads=1, timeout_s=600), mini_batch_samples=2, timeout_s=600)
    engines = None
    try:
        engines = RemoteEngines(RolloutWorkerSpec(EngineSpec(engine, path, options), weight_transfer="collective"),
                                workers=1, source=actor)
        size = sum(t.numel() * t.element_size() for t in engines.sync_state(actor.named_tensors()).values())
        out = {"model": model, "params_m": size / 4e6, "mib": size / 2**20}
        ways = {"driver": (None, lambda: engines.update_weights(list(actor.named_tensors()))),
                "ranks": (actor, lambda: actor.sync_weights(engines))}
        sums = {}
        for way, (source, sync) in ways.items():
            engines.send_from(source)
            sync()  # warm-up
            seconds, peaks = [], []
            for _ in range(repeats):
                with RssPeak() as rss:
                    begin = time.perf_counter()
                    sync()
                    seconds.append(time.perf_counter() - begin)
                peaks.append(rss.peak)
            sums[way] = engines.weights_checksums()
            out[way] = {"s": statistics.median(seconds), "rss_mib": max(peaks) / 2**20}
        out["same_weights"] = sums["driver"] == sums["ranks"]
    finally:
        if engines is not None:
            engines.close()
        actor.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-large", "random-300m"])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--dp2", action="store_true", help="the sender at dp = 2: the driver vs training rank 0")
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    folder = Path(tempfile.gettempdir()) / "vlmrl-bench-models"
    folder.mkdir(exist_ok=True)
    # --dp2: a logical CPU for each training worker and the rollout worker (the machine may have two cores)
    ray.init(num_cpus=3 if args.dp2 else 2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vlmrl-bt-"))
    rows = []
    try:
        for model in args.models:
            path = random_model(int(model.split("-")[1].rstrip("m")), folder) if model.startswith("random-") \
                else model
            row = (measure_senders if args.dp2 else measure)(path, args.engine, args.repeats, args.bucket_mb)
            row["model"] = model
            rows.append(row)
            print(row, flush=True)
    finally:
        ray.shutdown()
    print(f"\n{args.engine}, float32, buckets of {args.bucket_mb:g} MiB, median of {args.repeats}")
    ways = {"driver": "the driver sends", "ranks": "training rank 0 sends"} if args.dp2 else \
        {"object_store": "object store", "collective": "collective"}
    first, second = ways
    held = "" if args.dp2 else " / store held"
    print(f"| model | params | {ways[first]}: s / driver peak RSS{held} | {ways[second]}: s / driver peak RSS{held} "
          "| s ratio | same weights |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a, b = r[first], r[second]
        print(f"| {r['model']} | {r['params_m']:.0f} M ({r['mib']:.0f} MiB) | {_cell(a)} | {_cell(b)} | "
              f"{a['s'] / b['s']:.2f}x | {r['same_weights']} |")
    if not all(r["same_weights"] for r in rows):
        raise SystemExit("MISMATCH: the two ways left different weights in the engine")


def _cell(way: dict) -> str:
    """s / the driver's peak RSS above its start [/ the object store's bytes held], one way's table cell."""
    stored = f" / {way['store_mib']:.0f} MiB" if "store_mib" in way else ""
    return f"{way['s']:.2f} s / {way['rss_mib']:.1f} MiB{stored}"


if __name__ == "__main__":
    main()
