"""One-call GPU check: 3 GRPO steps of a random-init Qwen2.5-VL-3B (its real config, built here: no hub) with vLLM
colocated, then with SGLang where it is installed; prints tokens/s per GPU and the actor update's MFU (the run's
throughput/* metrics, EasyR1's definitions: vlmrl.trainer.throughput), peak GPU memory of training and of the rollout
engine, and weight-sync time.

Each backend runs the real trainer (`python -m vlmrl.train`) on the synthetic task with long random responses (a
random model rarely stops), in a subprocess of its own so that each engine is gone before the next starts. While it
runs, `nvidia-smi --query-compute-apps` is sampled every 0.5 s: the trainer's process is "train" (the actor: weights,
gradients, AdamW, activations), every other process of the GPU that appears meanwhile is the engine ("rollout").
Step figures come from the run's metrics.jsonl (timing/*, throughput/*).

    python benchmarks/gpu_check.py                    # on the GPU machine: ~10 GB of disk for the model
    python benchmarks/gpu_check.py --tiny --backends vllm --steps 1   # CPU dry check of the script itself
    python benchmarks/gpu_check.py --moe              # a Qwen3-VL-30B-A3B of 4 decoder layers instead (~3 B params)
    python benchmarks/gpu_check.py --moe --tiny --backends vllm --steps 1   # its CPU dry check (tiny-qwen3-vl-moe)
    python benchmarks/gpu_check.py --per-row-vision   # also each backend with the tower once per row (share_vision)

--moe: Qwen3-VL-30B-A3B's config (128 experts, top-8, expert intermediate 768, its full 27-layer vision tower with
three deepstack mergers) cut to 4 decoder layers so that the trainer (AdamW state included) and a colocated engine
fit one device; saved in the hub's expert layout (vlmrl.models.experts). EasyR1 publishes 80 tokens/s/GPU and MFU
1.8% for the full 30B-A3B on 8x H800: a 4-layer cut is not that job, and the report says so.

EasyR1 publishes ~1800 tokens/s per GPU and an MFU of 8.1% for Qwen2.5-VL-3B GRPO on 8x H100 (prompt + response
tokens over step time x GPUs; the update's model FLOPs over its time x GPUs x peak). MFU needs a known device (or
trainer.device_peak_flops): on CPU (--tiny) the column reads "-".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

QWEN25_VL_3B = {  # Qwen/Qwen2.5-VL-3B-Instruct config.json (architecture fields)
    "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                        "mrope_section": [16, 24, 24]},
             "use_sliding_window": False, "tie_word_embeddings": True},
    "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
               "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 2, "hidden_act": "silu"},
}


QWEN3_VL_30B_A3B = {  # Qwen/Qwen3-VL-30B-A3B-Instruct config.json (architecture fields), decoder cut to 4 layers
    "text": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
             "rms_norm_eps": 1e-6, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True}},
    "vision": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
               "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
               "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
}


def build_moe_model(target: Path, tiny: bool) -> Path:
    """The 4-layer Qwen3-VL-30B-A3B (or tiny-qwen3-vl-moe) with tiny-qwen3-vl-moe's tokenizer and processor files,
    its experts saved as the engines load them."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from vlmrl.models.experts import save_checkpoint_layout
    from vlmrl.models.families import family_of
    from vlmrl.models.tiny import ensure_built

    tiny_dir = Path(ensure_built("tiny-qwen3-vl-moe"))
    if tiny:
        shutil.copytree(tiny_dir, target, dirs_exist_ok=True)
        return target
    target.mkdir(parents=True, exist_ok=True)
    tokens = _placeholder_ids(tiny_dir)
    config = Qwen3VLMoeConfig(text_config=QWEN3_VL_30B_A3B["text"], vision_config=QWEN3_VL_30B_A3B["vision"],
                              tie_word_embeddings=False, **tokens)
    config.architectures = [Qwen3VLMoeForConditionalGeneration.__name__]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3VLMoeForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(target)
    save_checkpoint_layout(target, family_of(model.config), model.config)
    del model
    return _with_tokenizer_files(tiny_dir, target)


def _placeholder_ids(tiny_dir: Path) -> dict[str, int]:
    """The embedded model's image / video placeholder and delimiter ids (the config of a model built around its
    tokenizer must name them)."""
    ids = json.loads((tiny_dir / "config.json").read_text())
    return {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}


def _with_tokenizer_files(tiny_dir: Path, target: Path) -> Path:
    """`target` given the embedded model's tokenizer, chat template and processor files."""
    for file in tiny_dir.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy2(file, target / file.name)
    return target


def build_model(target: Path, tiny: bool) -> Path:
    """A random-init Qwen2.5-VL of the 3B config (or the tiny one) with the tiny model's tokenizer and processor
    files (their special-token ids are written into the config; the larger embedding just has unused rows)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vlmrl.models.tiny import ensure_built

    tiny_dir = Path(ensure_built("tiny"))
    if tiny:
        shutil.copytree(tiny_dir, target, dirs_exist_ok=True)
        return target
    target.mkdir(parents=True, exist_ok=True)
    tokens = _placeholder_ids(tiny_dir)
    config = Qwen2_5_VLConfig(text_config=QWEN25_VL_3B["text"], vision_config=QWEN25_VL_3B["vision"],
                              tie_word_embeddings=True, **tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(target)
    del model
    return _with_tokenizer_files(tiny_dir, target)


class GpuMemory:
    """Peak used GPU memory per process (MiB), sampled with nvidia-smi every 0.5 s; empty without nvidia-smi."""

    def __init__(self):
        self.peaks: dict[int, int] = {}
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()

    def __enter__(self):
        if self.available:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                      "nounits"], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                out = ""
            for line in out.strip().splitlines():
                pid, used = (int(x) for x in line.split(","))
                self.peaks[pid] = max(self.peaks.get(pid, 0), used)
            time.sleep(0.5)

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()


ASYNC = ["trainer.async_rollout.enable=true", "trainer.async_rollout.max_staleness=1",
         "trainer.async_rollout.rollout_workers=1", "algorithm.rollout_correction=token_tis"]
"""--async: the asynchronous placement beside each colocated run, its engine a rollout worker on GPU 1 (on a one-GPU
machine both share GPU 0)."""


def run_backend(name: str, model_dir: Path, out: Path, args, placement: list[str] | None = None,
                label: str | None = None) -> dict:
    overrides = [
        "config=examples/configs/tiny_synthetic.yaml", f"actor.model_path={model_dir}", f"rollout.name={name}",
        f"trainer.total_steps={args.steps}", "trainer.format_warmup_steps=0", "trainer.val_before_train=false",
        "trainer.test_freq=0", "trainer.save_freq=0", f"trainer.output_dir={out}", "trainer.torch_threads=0",
        f"data.max_response_length={args.response}", f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
        f"actor.ppo_mini_batch_size={args.prompts}", f"actor.micro_batch_tokens={args.micro_batch_tokens}",
        f"actor.ppo_micro_batch_size_per_gpu={args.micro}", "rollout.dtype=auto", "actor.compute_dtype=auto",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}", "rollout.timeout_s=1800",
        f"actor.gradient_checkpointing={str(not args.tiny).lower()}", f"actor.padding_free={str(args.padding_free).lower()}",
        *(placement or []),
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    with GpuMemory() as memory:
        proc = subprocess.Popen([sys.executable, "-m", "vlmrl.train", *overrides], cwd=ROOT, env=env)
        code = proc.wait()
    wall = time.perf_counter() - start
    backend = name + (label if label is not None else " async" if placement else "")
    if code != 0:
        return {"backend": backend, "error": f"exit code {code} (see {out})"}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in lines if "timing/step" in m and "timing/update" in m]
    last = steps[1:] or steps  # the first step pays compilation / CUDA-graph capture
    mean = lambda key: sum(m.get(key, 0.0) for m in last) / len(last)  # noqa: E731
    mfu = [m["throughput/mfu_actor"] for m in last if m.get("throughput/mfu_actor") is not None]
    train_mib = memory.peaks.get(proc.pid, 0)
    rollout_mib = sum(v for pid, v in memory.peaks.items() if pid != proc.pid)
    return {"backend": backend, "steps": len(steps),
            "samples_per_s": sum(m["batch/real_rows"] for m in last) / sum(m["timing/step"] for m in last),
            "step_s": mean("timing/step"), "rollout_s": mean("timing/rollout"),
            "update_s": mean("timing/update"), "sync_s": mean("timing/weight_sync"),
            "tokens_per_s_per_gpu": mean("throughput/tokens_per_s_per_gpu"),
            "mfu_actor": sum(mfu) / len(mfu) if mfu else None,
            "actor_tflops_per_gpu": mean("throughput/actor_tflops_per_gpu"),
            "response_tokens_per_s": mean("throughput/response_tokens_per_s"),
            "train_peak_mib": train_mib, "rollout_peak_mib": rollout_mib, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU dry check of this script)")
    parser.add_argument("--moe", action="store_true", help="Qwen3-VL-30B-A3B cut to 4 decoder layers (--tiny: "
                        "tiny-qwen3-vl-moe)")
    parser.add_argument("--backends", nargs="+", default=["vllm", "sglang"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--out", default="")
    parser.add_argument("--async", dest="async_placement", action="store_true",
                        help="also the asynchronous placement (a rollout worker on its own GPU) after each backend")
    parser.add_argument("--per-row-vision", action="store_true",
                        help="also each backend with actor.share_vision=false (the tower once per row): the update "
                             "time with the vision encoding shared across a prompt's samples against it")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="vlmrl-gpu-check-"))
    start = time.perf_counter()
    model_dir = (build_moe_model if args.moe else build_model)(out / "model", args.tiny)
    label = ("tiny-qwen3-vl-moe" if args.tiny else "Qwen3-VL-30B-A3B config cut to 4 decoder layers, random init") \
        if args.moe else ("tiny" if args.tiny else "Qwen2.5-VL-3B config, random init")
    print(f"model: {label} at {model_dir} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    results = []
    for name in args.backends:
        package = "sglang" if name.startswith("sglang") else name
        if name != "hf" and importlib.util.find_spec(package) is None:
            results.append({"backend": name, "error": f"{package} is not installed"})
            continue
        results.append(run_backend(name, model_dir, out / name, args))
        print(json.dumps(results[-1]), flush=True)
        if args.per_row_vision:
            shared = results[-1]
            results.append(run_backend(name, model_dir, out / f"{name}-per-row-vision", args,
                                       ["actor.share_vision=false"], label=" per-row vision"))
            print(json.dumps(results[-1]), flush=True)
            if "error" not in results[-1] and "error" not in shared:
                print(f"{name}: update time per-row vision / shared {results[-1]['update_s'] / shared['update_s']:.2f}x",
                      flush=True)
        if args.async_placement:
            results.append(run_backend(name, model_dir, out / f"{name}-async", args, ASYNC))
            print(json.dumps(results[-1]), flush=True)
            if "error" not in results[-1] and "error" not in results[-2]:
                print(f"{name}: async / colocated samples per second "
                      f"{results[-1]['samples_per_s'] / results[-2]['samples_per_s']:.2f}x", flush=True)
    print(f"\n{args.prompts} prompts x n={args.n}, responses up to {args.response} tokens, {args.steps} steps "
          "(means over the steps after the first)")
    print("| backend | tokens/s/GPU (prompt+response) | MFU (update) | update TFLOP/s/GPU | response tokens/s | step | "
          "rollout | update | weight sync | train peak GPU | rollout peak GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['backend']} | not run: {r['error']} | | | | | | | | | |")
            continue
        mfu = "-" if r["mfu_actor"] is None else f"{100 * r['mfu_actor']:.1f}%"
        print(f"| {r['backend']} | {r['tokens_per_s_per_gpu']:.0f} | {mfu} | {r['actor_tflops_per_gpu']:.1f} | "
              f"{r['response_tokens_per_s']:.0f} | "
              f"{r['step_s']:.1f} s | {r['rollout_s']:.1f} s | {r['update_s']:.1f} s | {r['sync_s']:.2f} s | "
              f"{r['train_peak_mib'] / 1024:.1f} GiB | {r['rollout_peak_mib'] / 1024:.1f} GiB |")


if __name__ == "__main__":
    main()
