#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU and no internet, install the carried wheels, run the
# `gpu`-marked tests that can run there, the tiny DAPO job end to end (bf16, colocated with offload, the
# weight-sync probe on, the phase ledger beside mem_get_info), the actor memory benchmark, the loss
# benchmark on CUDA and the rounds-vs-streaming rollout benchmark on the embedded engine on CUDA.
#
#   bash tools/gpu_check.sh --prepare      # HERE (with a package index): wheels/ for the device's python
#   bash tools/gpu_check.sh                # THERE, from the repository root (carry: ["wheels"])
#   bash tools/gpu_check.sh --dry-run      # anywhere: check the wheels, print the commands, build a summary
#   bash tools/gpu_check.sh --summary DIR  # the summary of the logs of an earlier run in DIR
#
# Time: the whole check ends within GPU_CHECK_BUDGET seconds (default 450: 7.5 minutes, so a machine start
# plus a rerun of the failed stages fit in 15 lent minutes; give the device tool timeout_s=480). Each stage
# has its own limit, sized for first CUDA compiles, and gets no more than what is left of the budget; a
# stage reached with under 20 s left is skipped. GPU_CHECK_STAGES="pytest tiny_dapo" reruns those stages
# only (install and cuda always run).
# Files: the logs stay in GPU_CHECK_LOGS (default /tmp/gpu_check_logs, emptied at the start); the results
# folder ($GPU_CHECK_OUT, else $OUT when the device tool sets it, else ./gpu_check_out) receives two files
# only, summary.txt (each stage's verdict and time, the tail of every failing stage's log) and summary.json
# (the same with the benchmarks' rows), both also printed: the JSON is the last line of stdout.
#
# wheels/ is gitignored: prepare it in the checkout that the device tool sends, and name it in `carry`.
# The device image (see the device notes) has Python 3.12, torch + CUDA, triton, transformers,
# safetensors, tensorboard, pytest; of our dependencies it lacks megatron-core only (pure Python but
# for a small helper, so the wheel is per Python version: GPU_CHECK_PY, default 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=run
case "${1:-}" in
  --prepare) MODE=prepare ;;
  --dry-run) MODE=dry ;;
  --summary) MODE=summary; GPU_CHECK_LOGS=${2:?--summary needs the logs folder of a run} ;;
  "") ;;
  *) echo "usage: bash tools/gpu_check.sh [--prepare | --dry-run | --summary LOGS]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
WHEELS=wheels
DEVICE_PY=${GPU_CHECK_PY:-3.12}
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-$PWD/gpu_check_out}}
LOG_DIR=${GPU_CHECK_LOGS:-/tmp/gpu_check_logs}
BUDGET=${GPU_CHECK_BUDGET:-450}
SELECTED=" install cuda ${GPU_CHECK_STAGES:-pytest tiny_dapo bench_actor bench_loss bench_dynamic} "
PACKAGES=("megatron-core==0.16.1")

if [ "$MODE" = prepare ]; then
  mkdir -p "$WHEELS"
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$DEVICE_PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
fi

mkdir -p "$OUT_DIR"
START=$(date +%s)
if [ "$MODE" != summary ]; then
mkdir -p "$LOG_DIR" && rm -rf "$LOG_DIR/tiny_dapo" "$LOG_DIR"/*.log "$LOG_DIR"/*.rc "$LOG_DIR"/*.s
# stage NAME SECONDS CMD...: run (or, dry, print) one stage under min(SECONDS, what is left of the budget);
# its output in $LOG_DIR/NAME.log, exit status in NAME.rc, wall seconds in NAME.s
stage() {
  local name=$1 secs=$2 t0 left; shift 2
  left=$(( BUDGET - 15 - ($(date +%s) - START) ))  # 15 s: a kill's grace and the summary
  [ "$secs" -gt "$left" ] && secs=$left
  if [[ "$SELECTED" != *" $name "* ]]; then echo "skipped: not selected" > "$LOG_DIR/$name.rc"; return 0; fi
  if [ "$secs" -lt 20 ]; then echo "skipped: budget" > "$LOG_DIR/$name.rc"; return 0; fi
  echo "== $name (timeout ${secs}s): $*" >&2
  if [ "$MODE" = dry ]; then echo "dry-run" > "$LOG_DIR/$name.rc"; : > "$LOG_DIR/$name.log"; return 0; fi
  t0=$(date +%s)
  timeout -k 5 "$secs" "$@" > "$LOG_DIR/$name.log" 2>&1
  echo $? > "$LOG_DIR/$name.rc"
  echo $(( $(date +%s) - t0 )) > "$LOG_DIR/$name.s"
}

ls "$WHEELS"/megatron_core-*.whl > /dev/null 2>&1 || {
  echo "no $WHEELS/megatron_core-*.whl: run 'bash tools/gpu_check.sh --prepare' where pip can download" >&2
  [ "$MODE" = dry ] || exit 2
}
# Limits (the sum, 710 s, is over the budget on purpose: a stage that ends early leaves its time to the
# next): first CUDA compiles dominate: ~30 Triton kernels in pytest, 5 fresh processes in bench_loss.
stage install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu_check_site "$WHEELS"/*.whl
export PYTHONPATH="$PWD:/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stage cuda 60 "$PY" tools/gpu_check.py cuda
stage pytest 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_kernels.py tests/test_kernels_loss.py tests/test_kernels_temperature.py tests/test_phases_gpu.py \
  tests/test_actor_gpu.py
# the tiny DAPO job end to end: embedded engine colocated with offload, bf16, Triton kernels, the probe
stage tiny_dapo 150 "$PY" tools/gpu_tiny_run.py --out "$LOG_DIR/tiny_dapo" --steps 3 --base-seconds 15
stage bench_actor 90 "$PY" tools/bench_actor.py --memory --json --device cuda --tokens 16384 --steps 3
stage bench_loss 90 "$PY" tools/bench_loss.py --device cuda --json --tokens 16384 --vocab 152064 \
  --impl naive fused fused_inplace naive_linear fused_linear
stage bench_dynamic 60 "$PY" tools/bench_rollout.py --dynamic --json --engines embedded --device cuda
fi

"$PY" tools/gpu_check.py summary "$LOG_DIR" "$OUT_DIR" "$MODE" "$(( $(date +%s) - START ))"
