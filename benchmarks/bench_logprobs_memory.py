"""Peak memory of the logprob + entropy pass (forward and backward) at Qwen2.5-VL's real vocabulary: chunked
(`actor.logprob_chunk_size`) vs today's unchunked pass, side by side in one process, values asserted equal.

The model is a random-init Qwen2.5-VL with the tiny text body (hidden 128, 2 layers) but the real vocabulary of
151,936 tokens, built in memory (no hub, nothing written): at this size the logits ARE the memory, as they are for a
7B model at r = 2048 (the body's activations grow with the hidden size, the logits with V).

Sides, per response length r (b = 2 rows, a 64-token prompt, text-only rows with explicit 3D position ids):
  - `today`: main's pass before chunking (the model's float32 logits (b, r + 1, V), then log_softmax and entropy);
  - `unchunked`: `forward_response(..., chunk=0)`;
  - `chunked`: `forward_response(..., chunk=N)` (the default of actor.logprob_chunk_size unless --chunk).
Each runs what the update runs: forward with entropy as a metric (`entropy_grad=False`, the default entropy_coeff=0),
then the backward of the token-mean logprob loss.

How memory is measured: torch's profiler with `profile_memory=True` records every allocation and free of torch's
CPU allocator (each tensor's storage) with its size; the running sum over the pass, from 0 at its start, peaks at
the most bytes the pass held at once beyond what existed before it. That counts tensors exactly, unlike RSS (glibc
keeps freed small blocks, and page faults lag allocations) or tracemalloc (which sees only Python's own allocator,
not torch's). As a cross-check the script also samples the process's RSS every millisecond in a thread and
reports the peak above the RSS before the pass.

    .venv/bin/python benchmarks/bench_logprobs_memory.py          # --lengths 1024 2048 --rows 2 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import psutil
import torch
from torch.profiler import ProfilerActivity, profile

from vlmrl.actor.config import ActorConfig
from vlmrl.actor.forward import MicroBatch, forward_response
from vlmrl.algorithms.grpo import entropy_from_logits, logprobs_from_logits

VOCAB = 151_936
PROMPT = 64


def build_model() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6},
                     "use_sliding_window": False},
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                       "out_hidden_size": 128, "fullatt_block_indexes": [0]},
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
        vision_end_token_id=VOCAB - 4, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).train()


def make_micro_batch(rows: int, response: int) -> MicroBatch:
    gen = torch.Generator().manual_seed(response)
    length = PROMPT + response
    ids = torch.randint(0, VOCAB - 8, (rows, length), generator=gen)
    positions = torch.arange(length).expand(3, rows, length).contiguous()  # text-only: the three mrope rows agree
    return MicroBatch(rows=list(range(rows)), input_ids=ids, attention_mask=torch.ones_like(ids),
                      position_ids=positions, response_width=response, pixel_values=None, image_grid_thw=None)


def today(model, mb: MicroBatch, temperature: float):
    """main's forward_response before chunking, verbatim in its math."""
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=mb.response_width + 1)
    logits = out.logits[:, :-1].float() / temperature  # (b, r, V)
    logprobs = logprobs_from_logits(logits, mb.input_ids[:, -mb.response_width :])
    with torch.no_grad():
        entropy = entropy_from_logits(logits)
    return logprobs, entropy


class RssPeak:
    """Samples the process's resident memory every millisecond while active; `peak` is the most above the start."""

    def __init__(self):
        self.process = psutil.Process()
        self.start = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss - self.start)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure(model, mb: MicroBatch, side, temperature: float):
    """(logprobs, entropy, grad of lm_head, peak torch bytes, peak RSS bytes, seconds) of forward + backward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    start = time.perf_counter()
    with RssPeak() as rss, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logprobs, entropy = side(model, mb, temperature)
        (-logprobs.mean()).backward()
    seconds = time.perf_counter() - start
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return logprobs.detach(), entropy, model.lm_head.weight.grad.clone(), peak, rss.peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=ActorConfig.logprob_chunk_size)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    sides = {
        "today": today,
        "unchunked": lambda m, mb, t: forward_response(m, mb, t, True, chunk=0),
        "chunked": lambda m, mb, t: forward_response(m, mb, t, True, chunk=args.chunk),
    }
    gib = 2**30
    print(f"V={VOCAB}, b={args.rows}, prompt={PROMPT}, chunk={args.chunk}, threads={args.threads}; peak bytes above "
          "the pass's start (torch allocator via the profiler; RSS sampled as a cross-check)")
    for response in args.lengths:
        mb = make_micro_batch(args.rows, response)
        results = {name: measure(model, mb, side, args.temperature) for name, side in sides.items()}
        ref_lp, ref_ent, ref_grad = results["today"][:3]
        for name, (lp, ent, grad, peak, rss, seconds) in results.items():
            if torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent):
                values = "identical"
            else:
                gap = max(float((lp - ref_lp).abs().max()), float((ent - ref_ent).abs().max()))
                values = f"{'within' if gap <= 1e-6 else 'MISMATCH,'} {gap:.1e}"
            # the lm_head gradient sums over tokens: chunks change the order of that float32 sum, nothing else
            grad_gap = float((grad - ref_grad).abs().max() / ref_grad.abs().max())
            grads = "identical" if grad_gap == 0 else f"{'within' if grad_gap <= 1e-6 else 'MISMATCH,'} {grad_gap:.1e}"
            ratio = results["today"][3] / peak
            print(f"r={response:5d} {name:10s} torch peak {peak / gib:6.2f} GiB  RSS peak {rss / gib:6.2f} GiB  "
                  f"{seconds:6.1f} s  {ratio:5.1f}x lower than today  logprobs+entropy: {values}  "
                  f"lm_head grad (max gap / max |grad|): {grads}")
        del results
        gc.collect()


if __name__ == "__main__":
    main()
