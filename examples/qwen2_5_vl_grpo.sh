#!/usr/bin/env bash
# GRPO for Qwen2.5-VL and Qwen3-VL with vlmrl.
#
#   examples/qwen2_5_vl_grpo.sh
#       The embedded default, on a CPU: the tiny random-init Qwen2.5-VL learns the synthetic colour task
#       (examples/configs/tiny_synthetic.yaml) with the vLLM backend (hf when vLLM is not installed; ROLLOUT=sglang
#       or ROLLOUT=hf picks another). A short format warm-up on RANDOM labels first teaches the answer format only;
#       validation accuracy then starts at chance (~0.25) and GRPO raises it. Writes outputs/demo/metrics.jsonl,
#       outputs/demo/curves.png, checkpoints every 50 steps and after the last (outputs/demo/checkpoints/latest links
#       to the newest) and the engine's own log lines (outputs/demo/engine.log). Run again, it resumes from the newest
#       checkpoint (a finished run has nothing left to do): delete outputs/demo or set OUTPUT_DIR to train afresh.
#   MODEL_PATH=tiny-qwen3-vl examples/qwen2_5_vl_grpo.sh
#       The same demo on the embedded tiny Qwen3-VL (any embedded name works: the demo's settings, that model;
#       outputs/demo-tiny-qwen3-vl).
#   VAL_ONLY=1 examples/qwen2_5_vl_grpo.sh
#       Validate-only: no optimizer, weights untouched; writes metrics and the per-sample artifact
#       (outputs/demo-val/validation_<backend>_step0.jsonl, see docs/artifact.md).
#   VAL_ONLY=1 MODEL_PATH=outputs/demo/checkpoints/latest examples/qwen2_5_vl_grpo.sh
#       The same on what the demo trained (a checkpoint of the embedded default keeps the embedded default's config;
#       writes outputs/demo-val/validation_<backend>_step150.jsonl).
#   MODEL_PATH=Qwen/Qwen2.5-VL-7B-Instruct DATA=geo3k ROLLOUT=vllm|sglang N_GPUS=8 [N_NODES=2] examples/qwen2_5_vl_grpo.sh
#       The real recipe, selected by any of MODEL_PATH (other than an embedded name or a checkpoint of the
#       embedded default), DATA, N_GPUS, N_NODES: examples/configs/qwen2_5_vl_geo3k.yaml,
#       close to verl/EasyR1's Qwen2.5-VL geo3k GRPO (lr 1e-6, n=5, low_var_kl 0.01, max_prompt_length 1024,
#       max_response_length 2048, max_pixels 1003520). DATA_DIR (default ~/data/geo3k) holds train.parquet and
#       test.parquet from examples/data/geo3k.py. More than one device runs Ray + FSDP2 workers (docs/distributed.md).
#   MODEL_PATH=Qwen/Qwen3-VL-8B-Instruct DATA=geo3k ROLLOUT=vllm|sglang N_GPUS=8 examples/qwen2_5_vl_grpo.sh
#       A Qwen3-VL model (its config.json says so, or a hub id not downloaded yet names Qwen3-VL) takes
#       examples/configs/qwen3_vl_geo3k.yaml instead: verl/EasyR1's Qwen3-VL geo3k GRPO, with Qwen3-VL's image
#       bounds (32 px per image token side; max_pixels 1310720). Writes outputs/qwen3_vl_geo3k.
#   RECIPE=dapo|gspo examples/qwen2_5_vl_grpo.sh  (with or without the real recipe's variables)
#       Another algorithm on top of either run: dapo (examples/configs/qwen2_5_vl_geo3k_dapo.yaml: clip-higher
#       0.2/0.28, token-mean, dynamic sampling, soft overlong punishment, no KL) or gspo (..._gspo.yaml:
#       sequence-level ratio clipped to 3e-4/4e-4, seq-mean-token-mean, no KL). With the real recipe the overlay
#       comes after qwen2_5_vl_geo3k.yaml; on the CPU demo only its losses are kept (tiny_synthetic.yaml is applied
#       after it) and DAPO's overlong buffer is scaled to the demo's 6-token budget. RECIPE=grpo (default) = plain.
#   LORA_RANK=64 [LORA_ALPHA=64] [LORA_VISION=off|tower|merger|tower+merger] examples/qwen2_5_vl_grpo.sh
#       LoRA adapters instead of full fine-tuning, on either run (actor.lora.rank / alpha / vision; README "LoRA"):
#       only the adapters train, the KL reference is the base with adapters disabled, vLLM serves the adapter itself
#       (SGLang gets merged weights). With the real recipe examples/configs/qwen2_5_vl_geo3k_lora.yaml comes after it
#       (EasyR1's rank 64 / alpha 64 / lr 1e-5); on the CPU demo examples/configs/tiny_synthetic_lora.yaml (the
#       random-init tiny model needs an adapter on lm_head too, and lr 1e-3; use LORA_RANK=16 there, rank 64
#       collapsed on some seeds: README "LoRA"). LORA_ALPHA defaults to LORA_RANK.
#
# Any key=value argument overrides the config (docs/config.md lists every key), e.g. trainer.total_steps=50.
# OUTPUT_DIR sets trainer.output_dir (defaults: outputs/demo, outputs/demo-<embedded name>, outputs/qwen2_5_vl_geo3k,
# outputs/qwen3_vl_geo3k; "_lora" added for LORA_RANK, "_dapo" / "_gspo" for RECIPE, "-val" for VAL_ONLY).
# DRY_RUN=1 prints the training command (one argument a line) instead of running it.
# PYTHON selects the interpreter (make demo passes the venv's). -h / --help prints this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi

# A checkpoint that the embedded default wrote (trained on synthetic data): validate or continue it on that default.
demo_checkpoint() {
  [[ -f "$1/trainer_state.json" ]] && "$PYTHON" -c 'import json, sys
config = json.load(open(sys.argv[1] + "/trainer_state.json")).get("config", {})
sys.exit(not str(config.get("data", {}).get("train_files", "")).startswith("synthetic"))' "$1"
}

# The geo3k recipe of a model's family: its config.json when it is a folder, else (a hub id) its name.
recipe_of() {
  "$PYTHON" - "$1" <<'EOF'
import re
import sys
from pathlib import Path

name = sys.argv[1]
folder = Path(name).expanduser()
if (folder / "config.json").exists():
    from vlmrl.models.families import family_for_path

    family = family_for_path(folder).name
else:  # a hub id: vlmrl.models downloads it later
    family = "Qwen3-VL" if re.search(r"qwen3[-_.]?vl", name, re.IGNORECASE) else "Qwen2.5-VL"
print({"Qwen2.5-VL": "qwen2_5_vl_geo3k", "Qwen3-VL": "qwen3_vl_geo3k"}[family])
EOF
}

is_embedded() {
  "$PYTHON" -c 'import sys; from vlmrl.models import is_embedded; sys.exit(not is_embedded(sys.argv[1]))' "$1"
}

ARGS=()
SUFFIX=""
OVERLAY=()
case "${RECIPE:-grpo}" in
  grpo) RECIPE="" ;;
  dapo|gspo) OVERLAY=("config=examples/configs/qwen2_5_vl_geo3k_${RECIPE}.yaml") ;;
  *) echo "RECIPE=${RECIPE}: use grpo (default), dapo or gspo" >&2; exit 2 ;;
esac
DEMO_MODEL=""
if [[ -n "${MODEL_PATH:-}" && -z "${DATA:-}${N_GPUS:-}${N_NODES:-}" ]] \
    && { is_embedded "$MODEL_PATH" || demo_checkpoint "$MODEL_PATH"; }; then
  DEMO_MODEL=$MODEL_PATH
  MODEL_PATH=""
fi
case "${VAL_ONLY:-0}" in
  1|true|yes) VAL_ONLY=1; SUFFIX="-val" ;;  # validate-only writes beside a training run's output, not into it
  0|false|no|"") VAL_ONLY=0 ;;
  *) echo "VAL_ONLY=${VAL_ONLY}: use 1 (validate only) or 0" >&2; exit 2 ;;
esac
if [[ -n "${MODEL_PATH:-}" || -n "${DATA:-}" || -n "${N_GPUS:-}" || -n "${N_NODES:-}" ]]; then
  if [[ -n "${DATA:-}" && "${DATA}" != "geo3k" ]]; then
    echo "DATA=${DATA}: the recipe knows geo3k; for other data leave DATA unset and pass" \
         "data.train_files=... data.val_files=... (with MODEL_PATH or N_GPUS to pick the real recipe)" >&2
    exit 2
  fi
  # ---- the real recipe ------------------------------------------------------------------------------------------
  DATA_DIR=${DATA_DIR:-$HOME/data/geo3k}
  MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}
  BASE=$(recipe_of "$MODEL_PATH")
  echo "recipe: examples/configs/$BASE.yaml for $MODEL_PATH" >&2
  ARGS+=("config=examples/configs/$BASE.yaml" "${OVERLAY[@]}"
         "actor.model_path=$MODEL_PATH"
         "rollout.name=${ROLLOUT:-vllm}"
         "data.train_files=$DATA_DIR/train.parquet" "data.val_files=$DATA_DIR/test.parquet"
         "trainer.n_gpus_per_node=${N_GPUS:-1}" "trainer.nnodes=${N_NODES:-1}"
         "trainer.output_dir=${OUTPUT_DIR:-outputs/$BASE${RECIPE:+_$RECIPE}$SUFFIX}")
else
  # ---- the embedded default on a CPU -------------------------------------------------------------------------------
  if [[ -z "${ROLLOUT:-}" ]]; then
    if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
      ROLLOUT=vllm
    else
      ROLLOUT=hf
      echo "vLLM is not installed: using the hf (transformers) rollout backend" >&2
    fi
  fi
  # In-process vLLM and SGLang's CPU code paths (no effect on GPU runs, which take the real recipe above).
  export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  export SGLANG_USE_CPU_ENGINE=${SGLANG_USE_CPU_ENGINE:-1}
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
  # the recipe's overlay FIRST: the demo's own settings (batch, lengths, lr) then win, its losses stay
  DEMO_DIR=outputs/demo
  if [[ -n "$DEMO_MODEL" && "$DEMO_MODEL" != "tiny" ]] && is_embedded "$DEMO_MODEL"; then
    DEMO_DIR=outputs/demo-$DEMO_MODEL  # another embedded model: beside the default's run, not resuming it
  fi
  ARGS+=("${OVERLAY[@]}" config=examples/configs/tiny_synthetic.yaml "rollout.name=$ROLLOUT"
         "trainer.output_dir=${OUTPUT_DIR:-$DEMO_DIR${RECIPE:+_$RECIPE}$SUFFIX}")
  if [[ "${RECIPE:-}" == "dapo" ]]; then
    ARGS+=(algorithm.overlong_buffer_len=1)  # DAPO's last fifth of the budget: 1 of the demo's 6 tokens
  fi
  if [[ -n "$DEMO_MODEL" ]]; then
    ARGS+=("actor.model_path=$DEMO_MODEL")
  fi
fi
if [[ -n "${LORA_RANK:-}" && "$VAL_ONLY" != "1" ]]; then
  if [[ -n "${MODEL_PATH:-}" || -n "${DATA:-}" || -n "${N_GPUS:-}" || -n "${N_NODES:-}" ]]; then
    ARGS+=(config=examples/configs/qwen2_5_vl_geo3k_lora.yaml
           "trainer.output_dir=${OUTPUT_DIR:-outputs/qwen2_5_vl_geo3k_lora${RECIPE:+_$RECIPE}}")
  else
    ARGS+=(config=examples/configs/tiny_synthetic_lora.yaml  # lm_head adapted too, lr 1e-3: README "LoRA"
           "trainer.output_dir=${OUTPUT_DIR:-outputs/demo_lora${RECIPE:+_$RECIPE}}")
  fi
  ARGS+=("actor.lora.rank=$LORA_RANK" "actor.lora.alpha=${LORA_ALPHA:-$LORA_RANK}"
         "actor.lora.vision=${LORA_VISION:-off}")
fi
if [[ "$VAL_ONLY" == "1" ]]; then
  ARGS+=(trainer.val_only=true)
fi

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%s\n' "$PYTHON" -m vlmrl.train "${ARGS[@]}" "$@"
  exit 0
fi
start=$(date +%s)
"$PYTHON" -m vlmrl.train "${ARGS[@]}" "$@"
elapsed=$(( $(date +%s) - start ))

# The curve, on one screen: validation accuracy by step, from metrics.jsonl.
"$PYTHON" - "${ARGS[@]}" "$@" <<'EOF'
import sys
from pathlib import Path
from vlmrl.config import load_config
from vlmrl.trainer.metrics import read_metrics
out = Path(load_config(sys.argv[1:], check_model=False).trainer.output_dir)
curve = [(r["step"], r["val/accuracy"]) for r in read_metrics(out / "metrics.jsonl") if "val/accuracy" in r]
if curve:
    print("val/accuracy by step: " + ", ".join(f"{s}: {a:.2f}" for s, a in curve))
    if len(curve) > 1:
        print(f"rise from step 0: {curve[-1][1] - curve[0][1]:+.2f} (best {max(a for _, a in curve) - curve[0][1]:+.2f})")
extra = [str(out / name) for name in ("curves.png", "checkpoints/latest", "engine.log") if (out / name).exists()]
print(f"outputs: {out}/metrics.jsonl" + "".join(f", {path}" for path in extra))
EOF
echo "wall time: ${elapsed} s"
