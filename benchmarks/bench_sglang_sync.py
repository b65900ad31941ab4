"""An SGLang weight sync's cost, and where it goes: the tensors' load against the cache flush after it, the flush
as a load of no tensors with flush_cache (what the sglang backend does) against SGLang's flush_cache call, side by
side on one engine (tiny, fp32, in-process SGLang on CPU).

On a CPU, SGLang's flush_cache runs a garbage-collection pass in its scheduler (its CPU platform's empty_cache); the
flush that a weight update does itself skips it.

    .venv/bin/python benchmarks/bench_sglang_sync.py   # --model tiny --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built
    from vlmrl.rollout.registry import get_backend

    path = str(ensure_built(args.model))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    times: dict[str, list[float]] = {"sync (backend.update_weights)": [], "load": [], "flush by an empty load": [],
                                     "flush_cache call": []}
    with get_backend("sglang", path, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        backend.update_weights(named)  # warm-up
        state = list(backend.sync_state(named).items())
        for _ in range(args.repeats):
            begin = time.perf_counter()
            backend.update_weights(named)
            times["sync (backend.update_weights)"].append(time.perf_counter() - begin)
            backend.engine.begin_weight_update()
            begin = time.perf_counter()
            assert backend.engine.update_weights_from_tensor(state, flush_cache=False)[0]
            loaded = time.perf_counter()
            assert backend.engine.update_weights_from_tensor([], flush_cache=True)[0]
            times["load"].append(loaded - begin)
            times["flush by an empty load"].append(time.perf_counter() - loaded)
            backend.engine.end_weight_update()
            begin = time.perf_counter()
            assert backend.engine.flush_cache().success
            times["flush_cache call"].append(time.perf_counter() - begin)
    print(f"{args.model}: {sum(t.numel() for _, t in named) / 1e6:.2f} M parameters, {args.repeats} repeats "
          "(median seconds)")
    for what, seconds in times.items():
        print(f"  {what:32s} {statistics.median(seconds):.4f}")
    ratio = statistics.median(times["flush_cache call"]) / statistics.median(times["flush by an empty load"])
    print(f"  flush_cache / empty-load flush: {ratio:.0f}x")


if __name__ == "__main__":
    main()
