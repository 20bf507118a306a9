#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU and no internet, install the carried wheels, run the
# `gpu`-marked tests that can run there, the loss benchmark on CUDA, the actor memory benchmark and the
# rounds-vs-streaming rollout benchmark on the embedded engine on CUDA, the tiny DAPO job end to end (bf16,
# colocated with offload, the weight-sync probe on, the phase ledger beside mem_get_info), and print ONE
# JSON summary line (last line of stdout). Budget: 9 minutes (each stage has its own timeout).
#
#   bash tools/gpu_check.sh --prepare      # HERE (with a package index): wheels/ for the device's python
#   bash tools/gpu_check.sh                # THERE, from the repository root (carry: ["wheels"])
#   bash tools/gpu_check.sh --dry-run      # anywhere: check the wheels, print the commands, build a summary
#   bash tools/gpu_check.sh --summary DIR  # the JSON summary of the logs of an earlier run in DIR
#
# wheels/ is gitignored: prepare it in the checkout that the device tool sends, and name it in `carry`.
# The device image (see the device notes) has Python 3.12, torch + CUDA, triton, transformers,
# safetensors, tensorboard, pytest; of our dependencies it lacks megatron-core only (pure Python but
# for a small helper, so the wheel is per Python version: GPU_CHECK_PY, default 3.12).
# Results: $GPU_CHECK_OUT (default $OUT when the device tool sets it, else ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=run
case "${1:-}" in
  --prepare) MODE=prepare ;;
  --dry-run) MODE=dry ;;
  --summary) MODE=summary; GPU_CHECK_OUT=${2:?--summary needs the folder of a run} ;;
  "") ;;
  *) echo "usage: bash tools/gpu_check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
WHEELS=wheels
DEVICE_PY=${GPU_CHECK_PY:-3.12}
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-$PWD/gpu_check_out}}
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
# stage NAME SECONDS CMD...: run (or, dry, print) one stage under its timeout; output in $OUT_DIR/NAME.log
stage() {
  local name=$1 secs=$2; shift 2
  echo "== $name (timeout ${secs}s): $*" >&2
  if [ "$MODE" = dry ]; then echo "dry-run" > "$OUT_DIR/$name.rc"; : > "$OUT_DIR/$name.log"; return 0; fi
  timeout "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo $? > "$OUT_DIR/$name.rc"
}

ls "$WHEELS"/megatron_core-*.whl > /dev/null 2>&1 || {
  echo "no $WHEELS/megatron_core-*.whl: run 'bash tools/gpu_check.sh --prepare' where pip can download" >&2
  [ "$MODE" = dry ] || exit 2
}
stage install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu_check_site "$WHEELS"/*.whl
export PYTHONPATH="$PWD:/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stage cuda 30 "$PY" -c "import torch, megatron.core; assert torch.cuda.is_available(), 'no CUDA'; \
print(torch.__version__, torch.cuda.get_device_name(), megatron.core.__version__)"
stage pytest 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_kernels.py tests/test_kernels_loss.py tests/test_kernels_temperature.py tests/test_phases_gpu.py \
  tests/test_actor_gpu.py
stage bench_loss 70 "$PY" tools/bench_loss.py --device cuda --json --tokens 16384 --vocab 152064 \
  --impl naive fused fused_inplace naive_linear fused_linear
stage bench_actor 60 "$PY" tools/bench_actor.py --memory --json --device cuda --tokens 16384 --steps 3
stage bench_dynamic 60 "$PY" tools/bench_rollout.py --dynamic --json --engines embedded --device cuda
# the tiny DAPO job end to end: embedded engine colocated with offload, bf16, Triton kernels, the probe
stage tiny_dapo 100 "$PY" tools/gpu_tiny_run.py --out "$OUT_DIR/tiny_dapo" --steps 3 --base-seconds 15
fi  # the stages' timeouts add up to 530 s: with the summary the check ends within 9 minutes

"$PY" - "$OUT_DIR" "$MODE" "$(( $(date +%s) - START ))" <<'EOF'
import json, re, sys
from pathlib import Path

out, mode, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


def stage(name):
    rc = (out / f"{name}.rc").read_text().strip() if (out / f"{name}.rc").exists() else "not run"
    log = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
    return rc, log


def json_lines(log):
    return [json.loads(l) for l in log.splitlines() if l.startswith("{")]


summary = {"mode": mode, "seconds": seconds, "stages": {}}
for name in ("install", "cuda", "pytest", "bench_loss", "bench_actor", "bench_dynamic", "tiny_dapo"):
    rc, log = stage(name)
    summary["stages"][name] = rc
    if name == "cuda" and log.strip():
        summary["cuda"] = log.strip().splitlines()[-1]
    if name == "pytest":
        counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", log))
        summary["pytest"] = counts
    if name in ("bench_loss", "bench_actor", "bench_dynamic", "tiny_dapo"):
        summary[name] = json_lines(log)
actor = {r["impl"]: r for r in summary["bench_actor"]}
if "naive" in actor:
    summary["actor_vs_naive"] = {k: {"peak": round(r["peak_loss_bytes"] / max(actor["naive"]["peak_loss_bytes"], 1), 4),
                                     "step_time": round(r["step_s"] / actor["naive"]["step_s"], 3)}
                                 for k, r in actor.items() if k != "naive"}
rounds = {r["ramble_frac"]: r for r in summary["bench_dynamic"] if r["mode"] == "rounds"}
summary["streaming_vs_rounds"] = {
    f'{r["mode"]}@{r["ramble_frac"]}': {"wall": round(r["wall_s"] / rounds[r["ramble_frac"]]["wall_s"], 3),
                                        "forward_passes": round(r["forward_passes"]
                                                                / max(rounds[r["ramble_frac"]]["forward_passes"], 1), 3)}
    for r in summary["bench_dynamic"] if r["mode"] != "rounds" and r["ramble_frac"] in rounds}
print(json.dumps(summary))
EOF
