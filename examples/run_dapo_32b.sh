#!/usr/bin/env bash
# DAPO on Qwen2.5-32B through Slurm: 16 nodes x 8 GPUs (H100 80 GB or H200 141 GB), the paper's
# hyper-parameters (Yu et al. 2025, §4.1), SGLang rollouts colocated with the Megatron actor.
#
#   bash examples/run_dapo_32b.sh [--nodes N --gpus-per-node G --time T --job-name J --output PATH
#                                  --partition P --account A --dry-run] [section.key=value ...]
#
# Outside an allocation the script checks the layout with the planner (python -m megatron_dapo.plan;
# a refused layout is not submitted), then submits ITSELF with sbatch. Inside the allocation:
# MASTER_ADDR = first host of the node list, a free MASTER_PORT, NCCL/thread env, HF -> Megatron
# conversion on first use (skipped once $MEGATRON_CKPT/COMPLETE exists), then one srun task per GPU
# running `python -m megatron_dapo.train`. The trainer starts the colocated SGLang servers itself
# (megatron_dapo/rollout/sglang/fleet.py: the first rank of every node starts that node's servers,
# rank 0 drives them all; they share the GPUs and sleep while the actor trains), so this script
# starts no server. checkpoint.resume=auto + --requeue: a requeued job (node
# failure, preemption, or the USR1 sent 10 min before the time limit) continues from the last
# checkpoint. On SIGTERM (preemption) or that USR1 the trainer finishes its step, saves it and exits
# (then the launcher requeues the job): keep the USR1 lead time above one step plus one save. Dotted overrides on the command line come last and win.
#
# Environment (all optional): NODES GPUS_PER_NODE CPUS_PER_TASK WALLTIME JOB_NAME LOG_DIR OUTPUT
# PARTITION ACCOUNT SBATCH_ARGS ("--qos=high ..."); HF_DIR MEGATRON_CKPT RUN_NAME CKPT_DIR TB_DIR
# TRAIN_DATA VAL_DATA MINI_BATCH_PROMPTS GPU_MEM_GB (planner: 80 for H100, 141 for H200); PLAN=0 skips
# the planner; DRY_RUN=1 prints the sbatch/srun commands and runs the planner and the trainer's
# --dry-run instead of submitting; FIRST_CONTACT=1 a short check of every phase first (below); PYTHON;
# MEGATRON_DAPO_SGLANG_PYTHON (the SGLang server's python).
#
# Parallel layout (python -m megatron_dapo.plan --config examples/configs/dapo_qwen2.5_32b.yaml
# --nodes 16 --gpus-per-node 8 prints the numbers):
#   actor TP=8 inside a node (NVLink; 40 query / 8 KV heads and FFN 27648 split by 8), PP=1 (64 layers
#     fit one stage: no pipeline bubbles, a simple colocated weight sync), DP=16 across nodes with the
#     distributed optimizer: per GPU 7.6 GiB bf16 weights + 15.3 GiB fp32 main grads + 2.9 GiB Adam
#     state (sharded /16) + ~5 GiB activations (22.5k-token sequences, full recomputation, sequence
#     parallel) = ~35 GiB with a 4 GiB reserve. On ONE node (DP=1) the unsharded Adam state alone is
#     46 GiB and the planner refuses 80 GB GPUs.
#   rollout: 32 SGLang engines of TP=4 (2 per node), mem_fraction_static 0.6 = 48 GiB per GPU while
#     the actor sleeps in host memory: 15.3 GiB weights + 32.7 GiB KV cache (256 KiB per token per
#     engine) = ~536k tokens, 23 worst-case (2k + 20k token) sequences in flight per engine.
#   On H200 (GPU_MEM_GB=141) the same layout leaves room: raise rollout.sglang.mem_fraction_static.
#SBATCH --job-name=dapo-qwen2.5-32b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
set -euo pipefail

_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${DAPO_ROOT:-}" ]; then
  if [ -f "$_here/launch_common.sh" ]; then DAPO_ROOT=$(cd "$_here/.." && pwd)
  elif [ -f "${SLURM_SUBMIT_DIR:-}/examples/launch_common.sh" ]; then DAPO_ROOT=$SLURM_SUBMIT_DIR
  else echo "run_dapo_32b.sh: set DAPO_ROOT to the repository (sbatch ran a copy of this script)" >&2; exit 2; fi
fi
export DAPO_ROOT
# shellcheck source=examples/launch_common.sh
source "$DAPO_ROOT/examples/launch_common.sh"
SCRIPT=$DAPO_ROOT/examples/run_dapo_32b.sh
cd "$DAPO_ROOT"  # relative paths below (and in the YAML) are relative to the repository root
CONFIG=examples/configs/dapo_qwen2.5_32b.yaml
PLAN=${PLAN:-1}
GPU_MEM_GB=${GPU_MEM_GB:-80}

# FIRST_CONTACT=1: a short run on the real layout before committing the cluster for days (see README, "On a GPU"):
# 3 steps of 64 prompts with responses up to 2k tokens, an evaluation, checkpoint saves, the weight-sync probe and
# the HF export; its own run name (started afresh each time), 1 hour; then one line per phase (phase_summary).
FIRST_CONTACT=${FIRST_CONTACT:-0}
if [ "$FIRST_CONTACT" = 1 ]; then
  RUN_NAME=${RUN_NAME:-dapo_qwen2.5_32b_first_contact}
  JOB_NAME=${JOB_NAME:-dapo-32b-first-contact}
  WALLTIME=${WALLTIME:-01:00:00}
fi

HF_DIR=${HF_DIR:-models/Qwen2.5-32B}                       # local copy of Qwen/Qwen2.5-32B (base)
MEGATRON_CKPT=${MEGATRON_CKPT:-checkpoints/Qwen2.5-32B-megatron}  # converted on first use
RUN_NAME=${RUN_NAME:-dapo_qwen2.5_32b}
CKPT_DIR=${CKPT_DIR:-checkpoints}                          # -> checkpoints/$RUN_NAME/step_<N>/
TB_DIR=${TB_DIR:-runs}                                     # -> tensorboard --logdir runs
TRAIN_DATA=${TRAIN_DATA:-data/dapo-math-17k.parquet}
VAL_DATA=${VAL_DATA:-data/aime-2024.parquet}
# The paper's mini-batch is 512 RESPONSES = 32 prompts x G=16, i.e. 16 gradient updates per rollout
# step of 512 prompts; train.mini_batch_size counts prompts.
MINI_BATCH_PROMPTS=${MINI_BATCH_PROMPTS:-32}

MODEL_ARGS=(
  model.hf_dir="$HF_DIR"                 # tokenizer, config and the rollout engine's initial weights
  model.load="$MEGATRON_CKPT"            # the actor's initial weights (converted from HF_DIR)
  model.dtype=bfloat16
  model.recompute=full                   # 22.5k-token sequences: keep only each layer's input
)
PARALLEL_ARGS=(
  parallel.tensor_parallel=8             # one node's NVLink domain
  parallel.pipeline_parallel=1
  parallel.sequence_parallel=true
  parallel.backend=nccl
  actor.optimizer.distributed_optimizer=true   # Adam state sharded over DP=16
  actor.micro_batch_tokens=24576         # one 2k + 20k-token sequence per micro-batch at most
)
ROLLOUT_ARGS=(
  rollout.engine=sglang
  rollout.colocate=true                  # hybrid engine: SGLang and Megatron share the GPUs
  rollout.sglang.tensor_parallel=4
  rollout.sglang.mem_fraction_static=0.6
  rollout.max_prompt_len=2048
  rollout.max_response_len=20480         # 16384 expected + 4096 soft-punishment buffer
  rollout.temperature=1.0
  rollout.top_p=1.0
)
DAPO_ARGS=(
  algo.group_size=16                     # G responses per prompt
  algo.eps_low=0.2
  algo.eps_high=0.28                     # Clip-Higher
  algo.loss_agg_mode=token-mean          # token-level policy gradient loss
  algo.dynamic_sampling=true
  algo.max_gen_rounds=10
  algo.gen_batch_multiplier=3.0          # 1536 prompts per generation round
  algo.overlong_filtering=false
  reward.soft_overlong_punishment=true   # eq. 13, L_cache = 4096
  reward.overlong_cache_len=4096
  train.prompt_batch_size=512
  train.mini_batch_size="$MINI_BATCH_PROMPTS"
  actor.optimizer.lr=1e-6                # constant after 20 warm-up steps
  actor.optimizer.warmup_steps=20
  actor.optimizer.weight_decay=0.1
  actor.optimizer.grad_clip=1.0
  eval.n_samples=32                      # avg@32 on AIME 2024
  eval.temperature=1.0
  eval.top_p=0.7
  data.train_path="$TRAIN_DATA"
  data.val_path="$VAL_DATA"
)
LOGGING_ARGS=(
  logging.run_name="$RUN_NAME"
  logging.tensorboard_dir="$TB_DIR"
  checkpoint.dir="$CKPT_DIR"
  checkpoint.save_every=20
  checkpoint.resume=auto                 # a requeued job continues from its last checkpoint
)
FIRST_CONTACT_ARGS=(
  train.steps=3
  train.prompt_batch_size=64             # 2 updates of 32 prompts x 16 responses a step
  algo.max_gen_rounds=2
  rollout.max_response_len=2048
  reward.overlong_cache_len=512
  eval.every_steps=3 eval.n_samples=4 eval.max_prompts=32
  checkpoint.save_every=2 checkpoint.resume=none checkpoint.overwrite=true
  rollout.weight_sync_probe=true
)
TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${LOGGING_ARGS[@]}")
if [ "$FIRST_CONTACT" = 1 ]; then TRAIN_ARGS+=("${FIRST_CONTACT_ARGS[@]}"); fi

RUN_ENV=(
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
  CUDA_DEVICE_MAX_CONNECTIONS=1          # Megatron: TP / sequence-parallel kernels issue in order
  TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # a failed rank tears the job down instead of hanging it
  NCCL_DEBUG="${NCCL_DEBUG:-WARN}"       # site-specific NCCL_SOCKET_IFNAME / NCCL_IB_HCA go here
  PYTHONUNBUFFERED=1
  TOKENIZERS_PARALLELISM=false
)

CONVERT_CMD=("${PYTHON:-python}" tools/convert_hf_to_megatron.py --hf-dir "$HF_DIR" --save "$MEGATRON_CKPT"
             --tp 8 --pp 1)

# Inside the allocation, once before the trainer: HF -> Megatron on first use.
dapo_prepare() {
  if [ -f "$MEGATRON_CKPT/COMPLETE" ]; then
    dapo_log "Megatron checkpoint $MEGATRON_CKPT is complete: no conversion"
    return 0
  fi
  [ -f "$HF_DIR/config.json" ] || dapo_die "no Megatron checkpoint ($MEGATRON_CKPT) and no HF checkpoint ($HF_DIR/config.json)"
  [ -f tools/convert_hf_to_megatron.py ] || dapo_die "tools/convert_hf_to_megatron.py is missing"
  local force=()
  if [ -e "$MEGATRON_CKPT" ]; then force=(--force); fi  # left by an interrupted conversion (no COMPLETE)
  dapo_log "first use: converting $HF_DIR -> $MEGATRON_CKPT"
  srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_TASK" --gpus-per-node="$GPUS_PER_NODE" \
    "${CONVERT_CMD[@]}" "${force[@]}"
}
dapo_prepare_show() {
  echo "  # first use only (no $MEGATRON_CKPT/COMPLETE yet):"
  dapo_show srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_TASK" \
    --gpus-per-node="$GPUS_PER_NODE" "${CONVERT_CMD[@]}"
}

# Inside the allocation, after the trainer succeeded: FIRST_CONTACT's one line per phase (exit 1 if one never ran).
PHASE_SUMMARY_CMD=("${PYTHON:-python}" -m megatron_dapo.metrics.phase_summary --logdir "$TB_DIR/$RUN_NAME"
                   --checkpoints "$CKPT_DIR/$RUN_NAME")
if [ "$FIRST_CONTACT" = 1 ]; then
  dapo_after() { dapo_log "first contact, one line per phase:"; "${PHASE_SUMMARY_CMD[@]}"; }
  dapo_after_show() { echo "  # then (FIRST_CONTACT=1):"; dapo_show "${PHASE_SUMMARY_CMD[@]}"; }
fi

# Before a real submission: the job cannot start without weights.
dapo_presubmit() {
  if [ ! -f "$MEGATRON_CKPT/COMPLETE" ] && [ ! -f "$HF_DIR/config.json" ]; then
    echo "run_dapo_32b.sh: neither $HF_DIR/config.json nor $MEGATRON_CKPT/COMPLETE exists; download" \
         "Qwen/Qwen2.5-32B into $HF_DIR (or set HF_DIR / MEGATRON_CKPT) before submitting" >&2
    return 2
  fi
}

dapo_launch "$@"
