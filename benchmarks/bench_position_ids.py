"""Position ids: vlmrl's vectorised mrope ids vs transformers' Qwen2.5-VL `get_rope_index`, side by side.

256 left-padded prompts with 1-2 images each (patch grids 8..48 per side, as geometry/chart images give), expanded
ids as the trainer sees them. Both sides run on the same batch in this process at the same thread count; outputs are
asserted equal before any time is reported.

    .venv/bin/python benchmarks/bench_position_ids.py [--prompts 256] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def make_batch(num_prompts: int, image_token_id: int, vision_start: int, vision_end: int, pad_id: int, seed: int = 0):
    """(B, L) left-padded expanded ids, mask and the (N, 3) grids of every image, in row order."""
    rng = random.Random(seed)
    rows, grids = [], []
    for _ in range(num_prompts):
        ids = [rng.randrange(20, 700) for _ in range(rng.randint(20, 40))]  # system + user preamble
        for _ in range(rng.randint(1, 2)):
            h, w = 2 * rng.randint(4, 24), 2 * rng.randint(4, 24)
            grids.append([1, h, w])
            ids += [vision_start] + [image_token_id] * (h * w // 4) + [vision_end]
            ids += [rng.randrange(20, 700) for _ in range(rng.randint(10, 120))]
        rows.append(ids)
    length = max(map(len, rows))
    input_ids = torch.full((num_prompts, length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, length - len(ids):] = torch.tensor(ids)
        mask[i, length - len(ids):] = 1
    return input_ids, mask, torch.tensor(grids)


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ('prompts', 'repeats', 'threads'):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)

    from transformers import Qwen2_5_VLForConditionalGeneration

    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    path = str(ensure_built("tiny"))  # only its config matters here: spatial_merge_size 2, as every Qwen2.5-VL
    processor = load_processor(path)
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    start_id, end_id = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    input_ids, mask, grid = make_batch(args.prompts, processor.image_token_id, start_id, end_id,
                                       processor.pad_token_id)
    mm_token_type_ids = (input_ids == processor.image_token_id).to(torch.int32)

    def reference():
        with torch.no_grad():
            return hf_model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                                 image_grid_thw=grid, attention_mask=mask)[0]

    def ours():
        return processor.position_ids(input_ids, mask, grid)

    ours()  # warm-up (first-call allocations) for both sides alike
    reference()
    t_ref, expected = median_seconds(reference, args.repeats)
    t_ours, actual = median_seconds(ours, args.repeats)
    if not torch.equal(expected, actual):
        raise SystemExit("MISMATCH: vlmrl position ids differ from transformers' get_rope_index")
    print(f"batch: {args.prompts} prompts, {len(grid)} images, length {input_ids.shape[1]}, "
          f"{int(mask.sum())} real tokens; torch threads {args.threads}; median of {args.repeats}")
    print(f"transformers get_rope_index : {t_ref * 1e3:9.2f} ms  ({t_ref / args.prompts * 1e6:7.1f} us/prompt)")
    print(f"vlmrl mrope_position_ids    : {t_ours * 1e3:9.2f} ms  ({t_ours / args.prompts * 1e6:7.1f} us/prompt)")
    print(f"outputs equal: yes; speed-up: {t_ref / t_ours:.1f}x")


if __name__ == "__main__":
    main()
