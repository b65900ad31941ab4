"""Per-step image preprocessing at geo3k's shape: vlmrl's once-per-prompt path against the per-row path and a
verl-agent-loop-like path, side by side in one process on the same rows.

Workload: --prompts prompts x n samples, each prompt one PNG-encoded image of 512..2048 pixels a side (geo3k-like
sizes) and a short question; the model is the embedded tiny Qwen2.5-VL with Qwen2.5-VL's default pixel bounds and the
geo3k recipe's max_pixels (1280 image tokens), so images are resized as in the recipe. Timed, per step:
  - vlmrl: each prompt's image decoded, checked and resized once (`Processor.build_request`) and turned into
    pixel_values once (`Processor.prompt_inputs`), shared by the prompt's n samples and every pass;
  - per row: the same two calls once per sample (what a per-sample pipeline computes);
  - verl-like: the image decoded and resized once per prompt (its dataset) and transformers' processor run on the
    chat text and the image once per sample (its agent loop's `_compute_multi_modal_inputs`-style recomputation).
The three must give the same pixel_values for every sample (checked). The GRPO step's full preprocessing at
--scale-to prompts (512 in the geo3k recipe) is the measured time x scale-to / prompts.

    .venv/bin/python benchmarks/bench_preprocess.py          # --prompts 32 --n 5 --scale-to 512
"""

from __future__ import annotations

import argparse
import io
import random
import shutil
import tempfile
import time

import numpy as np
import torch
from bench_postprocess import prepare_model_dir  # the tiny model with Qwen2.5-VL's default pixel bounds


def rows(prompts: int, seed: int) -> list[dict]:
    from PIL import Image

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        w, h = rng.randint(512, 2048), rng.randint(512, 2048)
        image = Image.fromarray(np_rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8), "RGB").resize((w, h))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append({"data_source": "bench", "prompt": [{"role": "user", "content": "<image>Find x in the figure."}],
                    "images": [{"bytes": buffer.getvalue()}], "reward_model": {"ground_truth": "1"}})
    return out


def vlmrl_path(processor, data, n):
    return [processor.prompt_inputs(processor.build_request(row, i)) for i, row in enumerate(data)]


def per_row_path(processor, data, n):
    return [processor.prompt_inputs(processor.build_request(row, i)) for i, row in enumerate(data) for _ in range(n)]


def verl_like_path(processor, data, n):
    out = []
    for i, row in enumerate(data):
        request = processor.build_request(row, i)  # the dataset's one decode + resize per prompt
        text = processor.tokenizer.decode(request.prompt_ids)
        for _ in range(n):
            out.append(processor.hf_processor(text=[text], images=list(request.images), return_tensors="pt"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--scale-to", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from vlmrl.data.config import DataConfig
    from vlmrl.processors.qwen_vl import load_processor

    tmp = tempfile.mkdtemp(prefix="vlmrl-bench-pre-")
    try:
        processor = load_processor(prepare_model_dir(tmp), DataConfig(max_prompt_length=4096, max_pixels=1003520))
        data = rows(args.prompts, args.seed)
        vlmrl_path(processor, data[:1], 1)  # first-call costs paid by no side
        results, outputs = {}, {}
        for name, path in (("vlmrl (once per prompt)", vlmrl_path), ("per row", per_row_path),
                           ("verl-like (processor per sample)", verl_like_path)):
            start = time.perf_counter()
            outputs[name] = path(processor, data, args.n)
            results[name] = time.perf_counter() - start
        ours = outputs["vlmrl (once per prompt)"]
        for i, (row_inputs, verl_inputs) in enumerate(zip(outputs["per row"][:: args.n],
                                                          outputs["verl-like (processor per sample)"][:: args.n])):
            expected = ours[i].multi_modal_inputs["pixel_values"]
            if not (torch.equal(row_inputs.multi_modal_inputs["pixel_values"], expected)
                    and torch.equal(verl_inputs["pixel_values"], expected)):
                raise SystemExit(f"MISMATCH: prompt {i}'s pixel_values differ between the paths")
        scale = args.scale_to / args.prompts
        base = results["vlmrl (once per prompt)"]
        print(f"{args.prompts} prompts x n={args.n}, one 512..2048-pixel-side PNG each, max_pixels 1003520; "
              f"torch threads {args.threads}")
        print(f"| path | measured | at {args.scale_to} prompts | vs vlmrl |")
        print("|---|---|---|---|")
        for name, seconds in results.items():
            print(f"| {name} | {seconds:.2f} s | {seconds * scale:.0f} s | {seconds / base:.2f}x |")
        print("pixel_values equal on every path")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
