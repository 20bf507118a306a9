#!/usr/bin/env bash
# The embedded default: tiny DAPO on CPU (a small Qwen2 policy on the built-in arithmetic task).
#
#   bash examples/run_dapo_tiny.sh [section.key=value ...]            # here, in the foreground, 1 process
#   LAUNCH=slurm bash examples/run_dapo_tiny.sh [flags] [overrides]   # through Slurm: 2 ranks, gloo
#   sbatch examples/run_dapo_tiny.sh [overrides]                      # the same, from the repository root
#
# LAUNCH=local (the default outside a Slurm allocation): checks the config, builds the tiny base
# model into checkpoints/tiny_base if it is missing (about 3 min, once; skipped when model.hf_dir is
# overridden), then runs `python -m megatron_dapo.train --config examples/configs/tiny_cpu.yaml
# overrides` and exits with its status. TensorBoard: runs/tiny_cpu/.
#
# LAUNCH=slurm (the default inside an allocation): the same launcher as examples/run_dapo_32b.sh
# (examples/launch_common.sh) with CPU settings: outside an allocation it submits itself with sbatch
# and prints the job id; inside it runs 2 srun tasks (data parallel DP=2, TP=1, gloo) with
# MASTER_ADDR / MASTER_PORT set. Flags (Slurm only): --nodes --tasks-per-node --time --job-name
# --output --partition --account --dry-run; env: TASKS_PER_NODE, LOG_DIR, OUTPUT, PARTITION, ...
# (see examples/launch_common.sh). DRY_RUN=1 prints the commands and runs the trainer's --dry-run.
# Preemption: Slurm's SIGTERM, or the SIGUSR1 sent 120 s before the time limit, makes the trainer finish
# its step, save it and exit; the job is requeued and resumes from that checkpoint.
#SBATCH --job-name=dapo-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
set -euo pipefail

_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${DAPO_ROOT:-}" ]; then
  if [ -f "$_here/launch_common.sh" ]; then DAPO_ROOT=$(cd "$_here/.." && pwd)
  elif [ -f "${SLURM_SUBMIT_DIR:-}/examples/launch_common.sh" ]; then DAPO_ROOT=$SLURM_SUBMIT_DIR
  else echo "run_dapo_tiny.sh: set DAPO_ROOT to the repository (sbatch ran a copy of this script)" >&2; exit 2; fi
fi
export DAPO_ROOT
cd "$DAPO_ROOT"
CONFIG=examples/configs/tiny_cpu.yaml
TINY_BASE=checkpoints/tiny_base
PYTHON=${PYTHON:-python}

# Build the tiny base on first use, unless the command line points model.hf_dir elsewhere.
ensure_tiny_base() {
  local arg
  for arg in "$@"; do
    case "$arg" in model.hf_dir=*) return 0 ;; esac
  done
  "$PYTHON" -c 'import sys; from megatron_dapo.tiny import ensure_tiny_base; ensure_tiny_base(sys.argv[1])' "$TINY_BASE"
}

LAUNCH=${LAUNCH:-auto}
if [ "$LAUNCH" = auto ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then LAUNCH=slurm; else LAUNCH=local; fi
fi

case "$LAUNCH" in
  local)
    if [ "${DRY_RUN:-0}" = 1 ]; then
      exec "$PYTHON" -m megatron_dapo.train --config "$CONFIG" --world-size 1 --dry-run "$@"
    fi
    # a config error fails here, in a second, before the tiny base is built
    "$PYTHON" -m megatron_dapo.config --config "$CONFIG" --world-size 1 "$@" >/dev/null
    ensure_tiny_base "$@"
    exec "$PYTHON" -m megatron_dapo.train --config "$CONFIG" "$@"
    ;;
  slurm) ;;
  *) echo "run_dapo_tiny.sh: LAUNCH=$LAUNCH: use local or slurm" >&2; exit 2 ;;
esac

# shellcheck source=examples/launch_common.sh
source "$DAPO_ROOT/examples/launch_common.sh"
SCRIPT=$DAPO_ROOT/examples/run_dapo_tiny.sh
PLAN=0                                   # CPU run: nothing for the GPU planner to size
TRAIN_ARGS=(
  parallel.backend=gloo                  # CPU
  parallel.tensor_parallel=1             # 2 ranks = DP=2 (mini-batch 16 prompts splits 8 + 8)
  parallel.pipeline_parallel=1
)
RUN_ENV=(
  OMP_NUM_THREADS=1                      # one thread per rank: 2 ranks fill a 2-core machine
  PYTHONUNBUFFERED=1
  TOKENIZERS_PARALLELISM=false
)
dapo_prepare() { ensure_tiny_base "${DAPO_OVERRIDES[@]}"; }
dapo_prepare_show() { echo "  # first use only: build $TINY_BASE (python tools/make_tiny_base.py --out $TINY_BASE)"; }

dapo_launch "$@"
