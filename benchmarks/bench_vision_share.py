"""The update's vision cost with the tower once per distinct image (actor.share_vision) against once per row, side by
side in one process, at n = 1, 5, 8, 16 samples per prompt.

Workload: --prompts prompts x n samples, each prompt one image of --side x --side merged patches (geo3k-like: its
images are ~1000 patches; the default 20 x 20 merged = 1600 patches) and ~40 text tokens, responses of 16..64 tokens
(short, so that the vision share of the step shows; geo3k's are ~300). One GRPO update (one optimizer step over all
rows, micro-batches of n rows so that a prompt's samples share a forward); both sides start from the same weights
and must give the same pg_loss and grad norm (rel 1e-5). Reported per n: update time of each side and their ratio,
the vision FLOPs (`vlmrl.models.flops.ModelFlops.vision_flops`, forward + backward) of what each side encodes, and
the vision part's own wall time: transformers' `get_image_features` (tower and mergers) forward and backward on one
micro-batch of a prompt's n samples, through the sharing wrapper or per row (`vision_time`).

    .venv/bin/python benchmarks/bench_vision_share.py                  # --model tiny --prompts 2 --side 20
    .venv/bin/python benchmarks/bench_vision_share.py --model tiny-large --prompts 1 --ns 1 5 8
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def workload(processor, prompts: int, n: int, side: int, seed: int):
    """A TrainBatch of prompts x n padded samples (random response tokens, random rewards)."""
    from PIL import Image

    from vlmrl.batch.padding import pad_sample, stack_samples

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    banned = set(processor.banned_token_ids)
    vocab = [t for t in range(100, 900) if t not in banned]
    factor = processor.image_factor
    samples = []
    for p in range(prompts):
        image = Image.fromarray(np_rng.integers(0, 256, (side * factor, side * factor, 3), dtype=np.uint8), "RGB")
        text = " ".join(rng.choice(["find", "the", "angle", "side", "x"]) for _ in range(40))
        row = {"data_source": "bench", "prompt": [{"role": "user", "content": "<image>" + text}], "images": [image],
               "reward_model": {"ground_truth": "1"}}
        prompt = processor.prompt_inputs(processor.build_request(row, p))
        for _ in range(n):
            ids = [rng.choice(vocab) for _ in range(rng.randint(16, 64))]
            sample = pad_sample(prompt, ids, prompt_length=len(prompt.input_ids), response_length=64,
                                pad_token_id=processor.pad_token_id)
            sample.reward = float(rng.random() > 0.5)
            samples.append(sample)
    return stack_samples(samples)


def update(model_dir: str, batch, state: dict, n: int, share: bool) -> tuple[float, dict]:
    from vlmrl.actor.config import ActorConfig, OptimConfig
    from vlmrl.actor.local import Actor
    from vlmrl.algorithms.grpo import group_advantages

    config = ActorConfig(model_path=model_dir, optim=OptimConfig(lr=1e-5), device="cpu", dtype="float32",
                         ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=n, share_vision=share)
    actor = Actor(config, total_steps=1, mini_batch_samples=len(batch))
    actor.model.load_state_dict(state)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    start = time.perf_counter()
    metrics = actor.update(batch, None, advantages)
    return time.perf_counter() - start, metrics


def vision_time(model, batch, rows: list[int], share: bool, repeats: int = 3) -> float:
    """Seconds of the vision part alone as the update runs it on one micro-batch of these rows: transformers'
    `get_image_features` (tower and mergers) forward and backward on the rows' images, through the sharing
    wrapper (`share`: one encoding per distinct image, its features handed to every row) or per row. The best of
    `repeats`."""
    from vlmrl.actor.vision_share import encoder_owner, shared_vision

    owner = encoder_owner(model)
    with_images = [batch.multi_modal_inputs[i] for i in rows if batch.multi_modal_inputs[i]]
    pixels = torch.cat([m["pixel_values"] for m in with_images])
    grid = torch.cat([m["image_grid_thw"] for m in with_images])
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with shared_vision(model, enabled=share):
            out = owner.get_image_features(pixels, grid, return_dict=True)
        features = out.pooler_output
        total = sum(f.sum() for f in (features if isinstance(features, (tuple, list)) else [features]))
        total.backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="an embedded model (tiny, tiny-large, tiny-qwen3-vl, ...)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--side", type=int, default=20, help="image side in merged patches")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 5, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForImageTextToText

    from vlmrl.data.config import DataConfig
    from vlmrl.models.flops import model_flops
    from vlmrl.processors.loading import load_processor

    tmp = tempfile.mkdtemp(prefix="vlmrl-bench-vision-")
    try:
        model_dir = model_with_large_images(args.model, tmp)
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        flops = model_flops(model.config)
        processor = load_processor(model_dir, DataConfig(max_prompt_length=8192, min_pixels=None, max_pixels=None))
        run(args, model_dir, state, flops, processor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_with_large_images(name: str, target: str) -> str:
    """The embedded model's files with pixel bounds large enough for geo3k-sized images (the embedded ones keep images
    at 16-64 tokens for the tests): 4 x 28 x 28 .. 2048 x factor^2 pixels."""
    from vlmrl.models.tiny import ensure_built

    shutil.copytree(ensure_built(name), target, dirs_exist_ok=True)
    config_path = Path(target) / "processor_config.json"
    config = json.loads(config_path.read_text())
    patch = config["image_processor"].get("patch_size", 14) * config["image_processor"].get("merge_size", 2)
    for section in ("image_processor", "video_processor"):
        if section in config and "shortest_edge" in config[section].get("size", {}):
            config[section]["size"] = {"shortest_edge": 4 * patch * patch, "longest_edge": 2048 * patch * patch}
    config_path.write_text(json.dumps(config, indent=2))
    return target


def run(args, model_dir: str, state: dict, flops, processor) -> None:
    side = args.side
    warm = workload(processor, 1, 2, 2, args.seed + 1)
    update(model_dir, warm, state, 2, True)  # first-call costs paid by no side
    print(f"model {args.model}, {args.prompts} prompt(s), one {side}x{side}-merged-patch image each "
          f"({side * side * 4} patches), torch threads {args.threads}")
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.load_state_dict(state)
    print("| n | samples | per-row update | shared update | time ratio | per-row vision TFLOPs | shared vision "
          "TFLOPs | FLOPs ratio | per-row vision time | shared vision time | vision time ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.ns:
        batch = workload(processor, args.prompts, n, side, args.seed)
        per_row, a = update(model_dir, batch, state, n, False)
        shared, b = update(model_dir, batch, state, n, True)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            if abs(a[key] - b[key]) > 1e-5 * max(abs(a[key]), 1e-6):
                raise SystemExit(f"MISMATCH at n={n}: {key} per-row {a[key]} vs shared {b[key]}")
        grid = [(1, 2 * side, 2 * side)]
        row_flops = flops.vision_flops(grid * (args.prompts * n)) / 1e12
        shared_flops = flops.vision_flops(grid * int(b["actor/vision_items_encoded"])) / 1e12
        group = list(range(n))  # one micro-batch: a prompt's n samples, as the update runs them
        row_time, shared_time = vision_time(model, batch, group, False), vision_time(model, batch, group, True)
        print(f"| {n} | {len(batch)} | {per_row:.2f} s | {shared:.2f} s | {per_row / shared:.2f}x | "
              f"{row_flops:.3f} | {shared_flops:.3f} | {row_flops / shared_flops:.1f}x | {row_time * 1e3:.0f} ms | "
              f"{shared_time * 1e3:.0f} ms | {row_time / shared_time:.2f}x |")
    print("pg_loss and grad_norm equal on both sides at every n (rel 1e-5)")


if __name__ == "__main__":
    main()
