"""Post-processing of finished samples into a train batch: vlmrl vs padding the whole batch afterwards vs verl 0.9.1.

Workload (the same on every side, rebuilt from one seed): 128 Qwen2.5-VL prompts x n=8 = 1024 samples, one image per
prompt (336..672 px sides -> 144..432 image tokens), prompt_length = response_length = 1024, responses of 64..1024
random tokens with logprobs. Model files: the embedded tiny Qwen2.5-VL with Qwen2.5-VL's default pixel bounds, so
that images keep a realistic size.

Sides (torch threads 1 everywhere; median of --repeats runs):
  vlmrl per-sample   `prompt_inputs` once per prompt (pixel values, expansion, mrope ids) + `pad_sample` as each
                     sample finishes + `stack_samples`. Only the stack (and the last sample) is on the critical path
                     after generation; the rest overlaps with it.
  vlmrl whole batch  the same outputs built after the last sample: pad every row, then one mrope call on (B, L).
  verl               `AgentLoopWorker._agent_loop_postprocess` per sample (3 tokenizer.pad calls, the processor on
                     the decoded text + images, transformers' get_rope_index) + `_postprocess` (stack). verl cannot
                     share our venv (transformers < 5.11), so this side runs in its own venv (see benchmarks/README.md)
                     through a subprocess of this same file (`--side verl`). Reported twice: as shipped, and with its
                     multi_modal_inputs cached per prompt (padding + position ids only: what vlmrl's pad_sample does).
Outputs are cross-checked: verl's input_ids, masks, logprobs and mrope rows must equal vlmrl's.

    .venv/bin/python benchmarks/bench_postprocess.py [--verl-python .bench-venv-verl/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT_LENGTH = RESPONSE_LENGTH = 1024
IMAGE_SIZES = [(448, 336), (560, 420), (336, 336), (672, 504)]  # multiples of 28: no resize on any side
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL's preprocessor defaults


def workload(num_prompts: int, n: int, seed: int, vocab: dict[str, int]) -> list[dict]:
    """Prompts as EXPANDED ids + one PIL image each, with n responses; identical in both venvs (no vlmrl import)."""
    from PIL import Image

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    prompts = []
    for p in range(num_prompts):
        width, height = IMAGE_SIZES[p % len(IMAGE_SIZES)]
        image = Image.fromarray(np_rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
        tokens = (width // 28) * (height // 28)
        before = [vocab["<|im_start|>"]] + [rng.randrange(20, 700) for _ in range(rng.randint(20, 60))]
        after = [rng.randrange(20, 700) for _ in range(rng.randint(20, 300))] + [vocab["<|im_end|>"]]
        expanded = before + [vocab["<|vision_start|>"]] + [vocab["<|image_pad|>"]] * tokens + [vocab["<|vision_end|>"]]
        expanded += after
        unexpanded = before + [vocab["<|vision_start|>"], vocab["<|image_pad|>"], vocab["<|vision_end|>"]] + after
        responses = []
        for _ in range(n):
            length = rng.randint(64, RESPONSE_LENGTH)
            ids = [rng.randrange(20, 700) for _ in range(length - 1)] + [vocab["<|im_end|>"]]
            responses.append((ids, [-rng.uniform(0.0, 5.0) for _ in range(length)]))
        prompts.append({"expanded": expanded, "unexpanded": unexpanded, "image": image, "responses": responses})
    return prompts


def median_seconds(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


# ---------------------------------------------------------------- vlmrl side


def run_vlmrl(model_dir: str, prompts: list[dict], repeats: int) -> tuple[dict, object]:
    from vlmrl.batch.padding import pad_sample, stack_samples
    from vlmrl.processors.loading import load_processor
    from vlmrl.types import RolloutRequest

    processor = load_processor(model_dir)
    requests = [RolloutRequest(uid=f"p{i}", prompt_ids=p["unexpanded"], images=[p["image"]])
                for i, p in enumerate(prompts)]
    pad = dict(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, pad_token_id=processor.pad_token_id)

    def shared_inputs():  # once per prompt: pixel values, expanded ids, the prompt's mrope ids
        return [processor.prompt_inputs(r) for r in requests]

    t_prompts, shared = median_seconds(shared_inputs, repeats)

    def per_sample():
        samples = [pad_sample(s, ids, rollout_logprobs=lp, **pad)
                   for s, p in zip(shared, prompts) for ids, lp in p["responses"]]
        start = time.perf_counter()
        batch = stack_samples(samples)
        return batch, time.perf_counter() - start

    per_sample()  # warm-up
    t_per_sample, (batch, tail) = median_seconds(per_sample, repeats)
    t_whole, whole = median_seconds(lambda: _whole_batch(processor, shared, prompts), repeats)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logprobs"):
        if not torch.equal(getattr(batch, name), getattr(whole, name)):
            raise SystemExit(f"MISMATCH: per-sample and whole-batch padding differ in {name}")
    return {"prompt_inputs": t_prompts, "per_sample": t_per_sample, "per_sample_tail": tail,
            "whole_batch": t_whole}, batch


def _whole_batch(processor, shared, prompts):
    """The alternative: keep raw samples until the last one finishes, then pad everything and compute the mrope ids
    of the whole (B, L) batch in one call."""
    from vlmrl.types import TrainBatch

    rows = [(s, ids, lp) for s, p in zip(shared, prompts) for ids, lp in p["responses"]]
    size, length = len(rows), PROMPT_LENGTH + RESPONSE_LENGTH
    input_ids = torch.full((size, length), processor.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(size, length, dtype=torch.long)
    logprobs = torch.zeros(size, RESPONSE_LENGTH)
    for i, (s, ids, lp) in enumerate(rows):
        n, r = s.input_ids.shape[0], len(ids)
        input_ids[i, PROMPT_LENGTH - n: PROMPT_LENGTH] = s.input_ids
        input_ids[i, PROMPT_LENGTH: PROMPT_LENGTH + r] = torch.tensor(ids)
        attention_mask[i, PROMPT_LENGTH - n: PROMPT_LENGTH + r] = 1
        logprobs[i, :r] = torch.tensor(lp)
    grid = torch.cat([s.multi_modal_inputs["image_grid_thw"] for s, _, _ in rows])
    positions = processor.position_ids(input_ids, attention_mask, grid).permute(1, 0, 2).contiguous()
    response_mask = attention_mask[:, PROMPT_LENGTH:].float()
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                      response_mask=response_mask, prompt_length=PROMPT_LENGTH,
                      multi_modal_inputs=[s.multi_modal_inputs for s, _, _ in rows],
                      uids=[s.uid for s, _, _ in rows], is_padding=torch.zeros(size, dtype=torch.bool),
                      rewards=torch.zeros(size), rollout_logprobs=logprobs)


# ---------------------------------------------------------------- verl side (runs in verl's venv)


def run_verl(model_dir: str, prompts: list[dict], repeats: int, out_file: str) -> dict:
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
    from verl.utils.tokenizer import hf_processor, hf_tokenizer

    worker = object.__new__(AgentLoopWorker)  # no Ray, no servers: only the post-processing methods are used
    worker.tokenizer, worker.processor = hf_tokenizer(model_dir), hf_processor(model_dir)
    worker.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    outputs = [AgentLoopOutput(prompt_ids=p["expanded"], response_ids=ids, response_mask=[1] * len(ids),
                               response_logprobs=lp, multi_modal_data={"images": [p["image"]]},
                               metrics=AgentLoopMetrics(), num_turns=2)
               for p in prompts for ids, lp in p["responses"]]

    async def postprocess_all():
        done = [await worker._agent_loop_postprocess(o, False, raw_prompt=[]) for o in outputs]
        return worker._postprocess(done)

    shipped = worker._compute_multi_modal_inputs
    timings = {}
    t, data = median_seconds(lambda: asyncio.run(postprocess_all()), max(1, repeats // 2))
    timings["verl_as_shipped"] = t
    cache: dict[int, dict] = {}

    def cached(output, input_ids):  # pixel values once per prompt, as vlmrl's prompt_inputs does
        key = id(output.multi_modal_data["images"][0])
        if key not in cache:
            cache[key] = shipped(output, input_ids)
        return dict(cache[key])

    worker._compute_multi_modal_inputs = cached
    asyncio.run(postprocess_all())  # fill the cache outside the timing
    timings["verl_cached_mm"], data = median_seconds(lambda: asyncio.run(postprocess_all()), repeats)

    from safetensors.torch import save_file

    batch = data.batch
    save_file({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
               "response_mask": batch["response_mask"].contiguous(), "position_ids": batch["position_ids"].contiguous(),
               "rollout_logprobs": batch["rollout_log_probs"].contiguous()}, out_file)
    return timings


def _cross_check(batch, verl_file: str) -> None:
    """verl's batch must hold exactly our tensors (its position ids are (B, 4, L): a text row + the mrope rows)."""
    from safetensors.torch import load_file

    theirs = load_file(verl_file)
    checks = {
        "input_ids": (batch.input_ids, theirs["input_ids"]),
        "attention_mask": (batch.attention_mask, theirs["attention_mask"]),
        "response_mask": (batch.response_mask.long(), theirs["response_mask"].long()),
        "mrope position_ids": (batch.position_ids, theirs["position_ids"][:, 1:]),
        "rollout_logprobs": (batch.rollout_logprobs, theirs["rollout_logprobs"].float()),
    }
    for name, (ours, verl) in checks.items():
        if ours.shape != verl.shape or not torch.allclose(ours.to(verl.dtype), verl):
            raise SystemExit(f"MISMATCH with verl in {name}: vlmrl {tuple(ours.shape)} vs verl {tuple(verl.shape)}")
    print("cross-check: verl's input_ids, attention_mask, response_mask, mrope rows and logprobs equal vlmrl's")


# ---------------------------------------------------------------- driver


def prepare_model_dir(target: str) -> str:
    """The tiny model's files with Qwen2.5-VL's default pixel bounds (realistic image sizes stay unresized)."""
    from vlmrl.models.tiny import ensure_built

    shutil.copytree(ensure_built("tiny"), target, dirs_exist_ok=True)
    config_path = Path(target) / "processor_config.json"
    config = json.loads(config_path.read_text())
    for section in ("image_processor", "video_processor"):
        config[section]["size"] = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
    config_path.write_text(json.dumps(config, indent=2))
    return target


def vocab_of(model_dir: str) -> dict[str, int]:
    names = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    return {name: added[name] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    default_verl = Path(__file__).resolve().parents[1] / ".bench-venv-verl" / "bin" / "python"
    parser.add_argument("--verl-python", default=str(default_verl))
    parser.add_argument("--side", choices=["main", "verl"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ('prompts', 'n', 'repeats'):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(1)

    if args.side == "verl":
        prompts = workload(args.prompts, args.n, 0, vocab_of(args.model_dir))
        print("VERL_RESULT " + json.dumps(run_verl(args.model_dir, prompts, args.repeats, args.out)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_model_dir(os.path.join(tmp, "model"))
        prompts = workload(args.prompts, args.n, 0, vocab_of(model_dir))
        samples = args.prompts * args.n
        ours, batch = run_vlmrl(model_dir, prompts, args.repeats)
        print(f"{samples} samples ({args.prompts} prompts x n={args.n}, one image each), P = R = {PROMPT_LENGTH}; "
              f"torch threads 1; median of {args.repeats}")
        print(f"vlmrl prompt_inputs, once per prompt (pixel values, ids)  : {ours['prompt_inputs']:8.3f} s")
        print(f"vlmrl pad_sample as samples finish + stack_samples        : {ours['per_sample']:8.3f} s, of which "
              f"{ours['per_sample_tail'] * 1e3:.1f} ms after the last sample (the stack)")
        print(f"vlmrl whole batch padded after the last sample            : {ours['whole_batch']:8.3f} s, all of it "
              f"after the last sample ({ours['whole_batch'] / ours['per_sample_tail']:.0f}x the per-sample tail)")
        verl = _run_verl_side(args, model_dir, tmp)
        if verl is None:
            return
        _cross_check(batch, os.path.join(tmp, "verl.safetensors"))
        total = ours["prompt_inputs"] + ours["per_sample"]
        print(f"verl post-processing as shipped (pixel values per sample) : {verl['verl_as_shipped']:8.3f} s "
              f"vs vlmrl {total:.3f} s (prompt_inputs + pad + stack): {verl['verl_as_shipped'] / total:.1f}x")
        print(f"verl with multi_modal_inputs cached per prompt            : {verl['verl_cached_mm']:8.3f} s "
              f"vs vlmrl {ours['per_sample']:.3f} s (pad + stack): {verl['verl_cached_mm'] / ours['per_sample']:.1f}x")


def _run_verl_side(args, model_dir: str, tmp: str) -> dict | None:
    if not Path(args.verl_python).exists():
        print(f"verl: NOT RUN - no interpreter at {args.verl_python} (build it as benchmarks/README.md says)")
        return None
    probe = subprocess.run([args.verl_python, "-c", "import verl.experimental.agent_loop.agent_loop"],
                           capture_output=True, text=True)
    if probe.returncode:
        print(f"verl: NOT RUN - verl cannot be imported in {args.verl_python}:\n{probe.stderr[-2000:]}")
        return None
    command = [args.verl_python, __file__, "--side", "verl", "--model-dir", model_dir, "--prompts", str(args.prompts),
               "--n", str(args.n), "--repeats", str(args.repeats), "--out", os.path.join(tmp, "verl.safetensors")]
    result = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("VERL_RESULT ")]
    if result.returncode or not lines:
        print(f"verl: FAILED (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return None
    return json.loads(lines[-1].removeprefix("VERL_RESULT "))


if __name__ == "__main__":
    sys.exit(main())
