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

And verl 0.9.1's own code, in its own venv (`--verl-python`, built as benchmarks/README.md says; the same
subprocess scheme as bench_postprocess.py): its agent loop's `AgentLoopWorker._compute_multi_modal_inputs` once per
sample on the same resized images and expanded prompt ids (+ an 8-token response), after the dataset's decode +
resize once per prompt (timed on this side: `Processor.build_request`, the same work). Its pixel_values must equal
vlmrl's for every prompt.

    .venv/bin/python benchmarks/bench_preprocess.py          # --prompts 32 --n 5 --scale-to 512
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

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


RESPONSE = 8  # response tokens after each sample's prompt on the verl side (text only: no pixel work)


def run_verl(folder: str, n: int) -> dict:
    """(verl's venv) verl's `_compute_multi_modal_inputs` once per sample on the main side's resized images and
    expanded prompt ids; saves each prompt's pixel_values for the cross-check."""
    from types import SimpleNamespace

    from PIL import Image
    from safetensors.torch import save_file
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.tokenizer import hf_processor, hf_tokenizer

    spec = json.loads((Path(folder) / "prompts.json").read_text())
    worker = object.__new__(AgentLoopWorker)  # no Ray, no servers: only the method is used
    worker.tokenizer, worker.processor = hf_tokenizer(spec["model_dir"]), hf_processor(spec["model_dir"])
    worker.mm_processor_kwargs = {}
    prompts = [(Image.open(Path(folder) / f"{i}.png").convert("RGB"), ids) for i, ids in enumerate(spec["ids"])]
    response = [spec["text_token"]] * RESPONSE
    start = time.perf_counter()
    first = {}
    for i, (image, ids) in enumerate(prompts):
        for k in range(n):
            output = SimpleNamespace(multi_modal_data={"images": [image]}, mm_processor_kwargs=None)
            inputs = worker._compute_multi_modal_inputs(output, torch.tensor([ids + response]))
            if k == 0:
                first[f"p{i}"] = inputs["pixel_values"].contiguous()
    seconds = time.perf_counter() - start
    save_file(first, str(Path(folder) / "verl_pixels.safetensors"))
    return {"seconds": seconds}


def verl_side(args, model_dir: str, processor, data, outputs, folder: str) -> float | None:
    """verl's own per-sample path in its venv on these prompts; None (with the reason printed) when it cannot run."""
    if not Path(args.verl_python).exists():
        print(f"verl: NOT RUN - no interpreter at {args.verl_python} (build it as benchmarks/README.md says)")
        return None
    text_token = processor.tokenizer.encode(" x", add_special_tokens=False)[0]
    os.makedirs(folder, exist_ok=True)
    for i, row in enumerate(data):
        processor.build_request(row, i).images[0].save(Path(folder) / f"{i}.png")  # lossless: the same pixels
    (Path(folder) / "prompts.json").write_text(json.dumps(
        {"model_dir": model_dir, "text_token": text_token,
         "ids": [o.input_ids.tolist() for o in outputs]}))
    command = [args.verl_python, __file__, "--side", "verl", "--folder", folder, "--n", str(args.n),
               "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("VERL_RESULT ")]
    if result.returncode or not lines:
        print(f"verl: FAILED (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return None
    from safetensors.torch import load_file

    theirs = load_file(str(Path(folder) / "verl_pixels.safetensors"))
    for i, ours in enumerate(outputs):
        if not torch.equal(theirs[f"p{i}"], ours.multi_modal_inputs["pixel_values"]):
            raise SystemExit(f"MISMATCH: verl's pixel_values for prompt {i} differ from vlmrl's")
    return json.loads(lines[-1].removeprefix("VERL_RESULT "))["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--scale-to", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    default_verl = Path(__file__).resolve().parents[1] / ".bench-venv-verl" / "bin" / "python"
    parser.add_argument("--verl-python", default=str(default_verl))
    parser.add_argument("--side", choices=["main", "verl"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.side == "verl":
        print("VERL_RESULT " + json.dumps(run_verl(args.folder, args.n)))
        return

    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    tmp = tempfile.mkdtemp(prefix="vlmrl-bench-pre-")
    try:
        model_dir = prepare_model_dir(os.path.join(tmp, "model"))
        processor = load_processor(model_dir, DataConfig(max_prompt_length=4096, max_pixels=1003520))
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
        start = time.perf_counter()
        for i, row in enumerate(data):  # the dataset's decode + resize once per prompt, as verl's dataset does
            processor.build_request(row, i)
        dataset = time.perf_counter() - start
        verl = verl_side(args, model_dir, processor, data, ours, os.path.join(tmp, "verl"))
        if verl is not None:
            results["verl 0.9.1 agent loop (dataset once per prompt + its `_compute_multi_modal_inputs` per sample)"] \
                = dataset + verl
        scale = args.scale_to / args.prompts
        base = results["vlmrl (once per prompt)"]
        print(f"{args.prompts} prompts x n={args.n}, one 512..2048-pixel-side PNG each, max_pixels 1003520; "
              f"torch threads {args.threads}")
        print(f"| path | measured | at {args.scale_to} prompts | vs vlmrl |")
        print("|---|---|---|---|")
        for name, seconds in results.items():
            print(f"| {name} | {seconds:.2f} s | {seconds * scale:.0f} s | {seconds / base:.2f}x |")
        print("pixel_values equal on every path" + (" (verl's too)" if verl is not None else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
