"""One GRPO update over 256 samples with geo3k-like lengths: fixed-row micro-batches vs token-budget micro-batches
(actor.micro_batch_tokens) vs token budget + the packed forward (actor.padding_free), side by side in one process.

Workload: 32 prompts x n = 8, each prompt one image of 12x9 .. 36x27 merged patches (108..972 image tokens) plus
30..120 text tokens, so prompts are ~150..1100 tokens as geo3k's are after expansion; responses long-tailed
(log-normal, median ~250, clipped to 50..2048). P = 1100, R = 2048. The model is the embedded tiny Qwen2.5-VL
with Qwen2.5-VL's default pixel bounds (so the images keep their size); float32 on the CPU.

Sides (same initial weights, the same batch, one optimizer step each; the pg_loss and grad norm are asserted equal):
  - fixed rows: ppo_micro_batch_size_per_gpu = 4, each micro-batch trimmed to its longest prompt + response;
  - token budget: micro_batch_tokens = 4 x (P + R), the fixed rows' worst micro-batch (so no higher peak memory);
  - token budget + packed: padding_free with --packed-budget tokens per pack (CPU attention builds a dense
    (T, T) mask per pack, so a pack is kept near one long row here; flash-attention's varlen has no such cost).
Reported: tokens the forwards process (padding included) and forwards over all 256 samples (plans only), and the
wall time of the update over the first --time-prompts prompts' samples (the whole update takes ~30 min per side on
the shared 2-core machine).

    .venv/bin/python benchmarks/bench_micro_batches.py        # --prompts 32 --n 8 --threads 2 --packed-budget 4096
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time

import numpy as np
import torch
from bench_postprocess import prepare_model_dir  # the tiny model with Qwen2.5-VL's default pixel bounds

PROMPT_LENGTH, RESPONSE_LENGTH = 1100, 2048


def workload(processor, prompts: int, n: int, seed: int):
    """A TrainBatch of prompts x n padded samples with random rewards."""
    from PIL import Image

    from vlmrl.batch.padding import pad_sample, stack_samples

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    banned = set(processor.banned_token_ids)
    vocab = [t for t in range(100, 900) if t not in banned]
    words = ["angle", "triangle", "side", "length", "find", "the", "of", "circle", "radius", "x", "y", "area"]
    samples = []
    for p in range(prompts):
        w, h = rng.randint(12, 36), rng.randint(9, 27)
        image = Image.fromarray(np_rng.integers(0, 256, (h * 28, w * 28, 3), dtype=np.uint8), "RGB")
        text = " ".join(rng.choice(words) for _ in range(rng.randint(30, 120)))
        row = {"data_source": "bench", "prompt": [{"role": "user", "content": "<image>" + text}],
               "images": [image], "reward_model": {"ground_truth": "1"}}
        prompt = processor.prompt_inputs(processor.build_request(row, p))
        for _ in range(n):
            length = int(min(RESPONSE_LENGTH, max(50, rng.lognormvariate(5.5, 0.8))))
            ids = [rng.choice(vocab) for _ in range(length)]
            sample = pad_sample(prompt, ids, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH,
                                pad_token_id=processor.pad_token_id)
            sample.reward = float(rng.random() > 0.5)
            samples.append(sample)
    return stack_samples(samples)


def run_side(model_dir: str, batch, timed, state: dict, **options) -> dict:
    """Tokens and forwards of the plan over `batch`; wall time of one update over `timed` (a subset of its rows)."""
    from vlmrl.actor.config import ActorConfig, OptimConfig
    from vlmrl.actor.local import Actor
    from vlmrl.actor.micro_batches import padded_tokens
    from vlmrl.algorithms.grpo import group_advantages

    config = ActorConfig(model_path=model_dir, optim=OptimConfig(lr=1e-5), device="cpu", dtype="float32",
                         ppo_mini_batch_size=len(batch), **options)
    actor = Actor(config, total_steps=1, mini_batch_samples=len(timed))
    actor.model.load_state_dict(state)
    plan = actor.micro_batches(batch, range(len(batch)))
    timed_plan = actor.micro_batches(timed, range(len(timed)))
    advantages = group_advantages(timed.rewards, timed.uids, timed.is_padding)
    start = time.perf_counter()
    metrics = actor.update(timed, None, advantages)
    seconds = time.perf_counter() - start
    return {"tokens": padded_tokens(batch, plan, config.padding_free), "forwards": len(plan), "seconds": seconds,
            "largest": max(padded_tokens(batch, [mb], config.padding_free) for mb in plan), "metrics": metrics,
            "timed_tokens": padded_tokens(timed, timed_plan, config.padding_free)}


def plan_table(model_dir: str, batch, sides: dict) -> None:
    """Forwards and tokens processed by each side's plan over the whole batch (no forward runs)."""
    from vlmrl.actor.config import ActorConfig
    from vlmrl.actor.core import ActorCore
    from vlmrl.actor.micro_batches import padded_tokens

    real = int(batch.attention_mask.sum())
    rows = []
    for name, options in sides.items():
        core = ActorCore.__new__(ActorCore)  # the planner needs only the config
        core.config = ActorConfig(model_path=model_dir, **options)
        plan = core.micro_batches(batch, range(len(batch)))
        tokens = padded_tokens(batch, plan, core.config.padding_free)
        largest = max(padded_tokens(batch, [mb], core.config.padding_free) for mb in plan)
        rows.append((name, len(plan), largest, tokens))
    print("| side | forwards | largest forward | tokens processed | padding | tokens ratio |")
    print("|---|---|---|---|---|---|")
    for name, forwards, largest, tokens in rows:
        print(f"| {name} | {forwards} | {largest} | {tokens} | {1 - real / tokens:.0%} | {rows[0][3] / tokens:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--packed-budget", type=int, default=4096)
    parser.add_argument("--time-prompts", type=int, default=8,
                        help="the update is timed on this many prompts' samples (the token counts use all)")
    parser.add_argument("--plan-only", action="store_true", help="count the tokens of each side's plan; time nothing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from vlmrl.distributed.sharding import select_rows
    from vlmrl.processors.loading import load_processor

    tmp = tempfile.mkdtemp(prefix="vlmrl-bench-mb-")
    try:
        model_dir = prepare_model_dir(tmp)
        processor = load_processor(model_dir)
        batch = workload(processor, args.prompts, args.n, args.seed)
        real = int(batch.attention_mask.sum())
        timed = select_rows(batch, range(args.time_prompts * args.n))
        from transformers import AutoModelForImageTextToText

        state = {k: v.clone() for k, v in AutoModelForImageTextToText.from_pretrained(model_dir).state_dict().items()}
        warm = workload(processor, 1, 2, args.seed + 1)  # first-call costs (allocator, kernels) paid by no side
        run_side(model_dir, warm, warm, state, ppo_micro_batch_size_per_gpu=2)
        budget = args.micro * (PROMPT_LENGTH + RESPONSE_LENGTH)
        sides = {
            f"fixed rows ({args.micro})": dict(ppo_micro_batch_size_per_gpu=args.micro),
            f"token budget ({budget})": dict(micro_batch_tokens=budget),
            f"token budget + packed ({args.packed_budget})": dict(micro_batch_tokens=args.packed_budget,
                                                                    padding_free=True),
        }
        lengths = batch.attention_mask.sum(dim=1).float()
        print(f"{len(batch)} samples, {real} real tokens (rows {int(lengths.min())}..{int(lengths.max())}, "
              f"median {int(lengths.median())}); torch threads {args.threads}")
        if args.plan_only:
            plan_table(model_dir, batch, sides)
            return
        results = {name: run_side(model_dir, batch, timed, state, **options) for name, options in sides.items()}
        base_name = next(iter(results))
        base = results[base_name]
        for name, r in results.items():
            for key in ("actor/pg_loss", "actor/grad_norm"):
                a, b = r["metrics"][key], base["metrics"][key]
                if abs(a - b) > 1e-4 * max(abs(b), 1e-6):
                    raise SystemExit(f"MISMATCH: {name} {key}={a} vs {base_name} {b}")
        print("| side | forwards | largest forward | tokens processed | padding | update time | tokens ratio | "
              "time ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['forwards']} | {r['largest']} | {r['tokens']} | "
                  f"{1 - real / r['tokens']:.0%} | {r['seconds']:.1f} s | {base['tokens'] / r['tokens']:.2f}x | "
                  f"{base['seconds'] / r['seconds']:.2f}x |")
        print("pg_loss and grad_norm equal on every side (rel 1e-4)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
