#!/usr/bin/env bash
# GRPO for Qwen2.5-VL and Qwen3-VL: picks a recipe in examples/configs/ and runs `python -m vlmrl.train` on it, then
# every key=value argument given (docs/config.md lists the keys; docs/training.md the recipes and what they measure).
# Used by: make demo (PYTHON=$(PY) bash examples/qwen2_5_vl_grpo.sh), the README's tour, tests/test_demo_script.py.
#
#   examples/qwen2_5_vl_grpo.sh [key=value ...]
#   examples/qwen2_5_vl_grpo.sh trainer.total_steps=50            # the CPU demo, shorter
#   RECIPE=dapo+lora MODEL_PATH=Qwen/Qwen2.5-VL-7B-Instruct N_GPUS=8 examples/qwen2_5_vl_grpo.sh actor.lora.rank=32
#
# MODEL_PATH  unset, an embedded name (tiny, tiny-qwen3-vl, tiny-qwen3.5) or a checkpoint the demo wrote: the CPU demo
#             (tiny_synthetic.yaml: the tiny model learns the synthetic colour task). Anything else: the geo3k recipe
#             of its family (qwen2_5_vl_geo3k.yaml, qwen3_vl_geo3k.yaml or qwen3_5_geo3k.yaml, by its config.json
#             or a hub id's name);
#             its data is ~/data/geo3k (elsewhere: data.train_files=DIR/train.parquet data.val_files=DIR/test.parquet).
# RECIPE      grpo (default), dapo, gspo, lora, dapo+lora or gspo+lora: overlays on that recipe (on the demo: their
#             losses; lora there is tiny_synthetic_lora.yaml, rank 16 with lm_head, else qwen2_5_vl_geo3k_lora.yaml).
#             distill: on-policy distillation, qwen2_5_vl_geo3k_distill.yaml (Qwen2.5-VL-7B teaching the 3B, which
#             MODEL_PATH then defaults to); on the demo tiny_synthetic_distill.yaml, the trained demo
#             (outputs/demo/checkpoints/latest: run the demo first) teaching a fresh tiny model.
# ROLLOUT     vllm (default; the demo takes hf when vLLM is not installed), sglang, sglang-server or hf.
# N_GPUS, N_NODES   devices per node and nodes; either picks the geo3k recipe (more than one device: Ray + FSDP2).
# VAL_ONLY=1  validate only: no optimizer, weights untouched, the per-sample artifact written (lora is ignored).
# OUTPUT_DIR  trainer.output_dir; default outputs/demo[-<embedded name>] or outputs/<recipe>, then _lora, _dapo|_gspo,
#             -val. A run restarted on the same folder resumes from its newest checkpoint.
# DRY_RUN=1 prints the command instead of running it, and for a geo3k recipe its memory plan per device on stderr
#             (python -m vlmrl.plan: docs/memory.md; PLAN=0 leaves it out); PYTHON picks the interpreter; -h
#             prints this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
for gone in DATA DATA_DIR LORA_RANK LORA_ALPHA LORA_VISION; do  # earlier versions' switches, keys now
  [[ -z "${!gone:-}" ]] || { echo "$gone is no longer read: MODEL_PATH or N_GPUS picks the geo3k recipe," \
    "data.train_files=DIR/train.parquet data.val_files=DIR/test.parquet place its data, RECIPE=lora with" \
    "actor.lora.rank=R actor.lora.alpha=A actor.lora.vision=V sets LoRA (docs/training.md)" >&2; exit 2; }
done
case "${RECIPE:=grpo}" in
  grpo|dapo|gspo|lora|grpo+lora|dapo+lora|gspo+lora|distill) ALGO=${RECIPE%+lora} ;;
  *) echo "RECIPE=$RECIPE: use grpo, dapo, gspo, lora, dapo+lora, gspo+lora or distill" >&2; exit 2 ;;
esac
case "${VAL_ONLY:-0}" in
  1|true|yes) VAL_ONLY=1 ;;
  0|false|no|"") VAL_ONLY="" ;;
  *) echo "VAL_ONLY=$VAL_ONLY: use 1 (validate only) or 0" >&2; exit 2 ;;
esac
[[ "$ALGO" == grpo || "$ALGO" == lora ]] && ALGO=""
LORA=""; [[ "$RECIPE" == *lora && -z "$VAL_ONLY" ]] && LORA=_lora

# The recipe, the default engine and output folder (examples/recipe.py says why each).
read -r BASE ENGINE DIR <<<"$("$PYTHON" examples/recipe.py pick "${MODEL_PATH:-}" "${N_GPUS:-}${N_NODES:-}")"
OVERLAYS=(${ALGO:+config=examples/configs/qwen2_5_vl_geo3k_$ALGO.yaml})
if [[ "$BASE" == demo && "$ALGO" == distill ]]; then  # the demo's teacher is the trained demo, not the 7B
  OVERLAYS=(config=examples/configs/tiny_synthetic_distill.yaml)
  TEACHER=outputs/demo/checkpoints/latest
  [[ -e "$TEACHER" || " $* " == *" algorithm.distill.teacher="* ]] || { echo "RECIPE=distill on the demo distils" \
    "the trained demo, $TEACHER, which does not exist: run the demo first (examples/qwen2_5_vl_grpo.sh) or pass" \
    "algorithm.distill.teacher=PATH" >&2; exit 2; }
fi
if [[ "$BASE" == demo ]]; then
  [[ -n "${ROLLOUT:-}" || "$ENGINE" == vllm ]] \
    || echo "vLLM is not installed: using the hf (transformers) rollout backend" >&2
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
  # the algorithm's overlay FIRST: the demo's own settings (batch, lengths, lr) then win, its losses stay
  ARGS=("${OVERLAYS[@]}" config=examples/configs/tiny_synthetic.yaml
        ${LORA:+config=examples/configs/tiny_synthetic_lora.yaml}
        "rollout.name=${ROLLOUT:-$ENGINE}" ${MODEL_PATH:+"actor.model_path=$MODEL_PATH"})
  [[ "$ALGO" == dapo ]] && ARGS+=(algorithm.overlong_buffer_len=1)  # DAPO's last fifth of the budget: 1 of 6 tokens
else
  STUDENT=Qwen/Qwen2.5-VL-7B-Instruct; [[ "$ALGO" == distill ]] && STUDENT=Qwen/Qwen2.5-VL-3B-Instruct
  MODEL_PATH=${MODEL_PATH:-$STUDENT}
  echo "recipe: examples/configs/$BASE.yaml for $MODEL_PATH" >&2
  ARGS=("config=examples/configs/$BASE.yaml" "${OVERLAYS[@]}"
        ${LORA:+config=examples/configs/qwen2_5_vl_geo3k_lora.yaml}
        "actor.model_path=$MODEL_PATH" "rollout.name=${ROLLOUT:-vllm}"
        "trainer.n_gpus_per_node=${N_GPUS:-1}" "trainer.nnodes=${N_NODES:-1}")
fi
ARGS+=("trainer.output_dir=${OUTPUT_DIR:-$DIR$LORA${ALGO:+_$ALGO}${VAL_ONLY:+-val}}" ${VAL_ONLY:+trainer.val_only=true})

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "$PYTHON" -m vlmrl.train "${ARGS[@]}" "$@"
  # the plan goes to stderr, so stdout stays the command alone; a plan that does not fit still ends the dry run well
  [[ "$BASE" == demo || "${PLAN:-1}" == 0 ]] || "$PYTHON" -m vlmrl.plan "${ARGS[@]}" "$@" >&2 || true
  exit 0
fi
start=$(date +%s)
"$PYTHON" -m vlmrl.train "${ARGS[@]}" "$@"
elapsed=$(( $(date +%s) - start ))
"$PYTHON" examples/recipe.py curve "${ARGS[@]}" "$@"  # the curve on one screen, from metrics.jsonl
echo "wall time: ${elapsed} s"
