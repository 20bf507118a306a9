# shellcheck shell=bash
# Shared Slurm launcher of examples/run_dapo_32b.sh and examples/run_dapo_tiny.sh (sourced, not run).
#
# A run script sets the variables below, optionally defines `dapo_prepare` (run once inside the
# allocation before the trainer, e.g. build or convert a checkpoint), `dapo_after` (once after a trainer
# that succeeded; its status becomes the job's) and `dapo_presubmit` (checks before a real submission),
# each with a `_show` twin for DRY_RUN where it has one, then calls `dapo_launch "$@"`:
#   outside an allocation  -> submits the calling script with `sbatch --parsable` (options from env /
#                             flags, which override its #SBATCH header) and prints the job id and log;
#   inside an allocation   -> MASTER_ADDR = first host of the node list, a free MASTER_PORT, the
#                             env below, then one srun task per GPU (or per CPU rank) running
#                             `python -m megatron_dapo.train --config $CONFIG ${TRAIN_ARGS[@]} overrides`;
#                             rank 0 of the trainer starts the (colocated) rollout engine itself.
#   DRY_RUN=1              -> prints the sbatch and srun commands instead of running them, and runs
#                             the planner ($PLAN=1) and `megatron_dapo.train --dry-run`; exit 1 if
#                             the planner refuses, 2 if the config is invalid.
#
# Variables (set by the run script; each can be overridden from the environment):
#   SCRIPT          the run script (submitted by sbatch)           CONFIG       trainer YAML
#   JOB_NAME NODES TASKS_PER_NODE GPUS_PER_NODE CPUS_PER_TASK WALLTIME LOG_DIR OUTPUT PARTITION ACCOUNT
#   SBATCH_EXTRA    array of more sbatch options                   SBATCH_ARGS  the same, as one string
#   SRUN_EXTRA      array of more srun options                     RUN_ENV      array of NAME=VALUE exported
#   TRAIN_ARGS      array of dotted overrides (after the YAML, before the command line's)
#   PLAN=1 GPU_MEM_GB  run `megatron_dapo.plan` before submitting (refusal = no submission)
#   PYTHON          interpreter (default: python)
# Flags accepted before the dotted overrides: --nodes N --gpus-per-node G --tasks-per-node T
#   --time T --job-name J --output PATH --partition P --account A --dry-run

dapo_log() { echo "[launch] $*"; }
dapo_die() { echo "[launch] error: $*" >&2; exit 2; }

# The repository root, also when sbatch runs a spooled copy of the script.
dapo_root() {  # script_path
  local here
  if [ -n "${DAPO_ROOT:-}" ]; then echo "$DAPO_ROOT"; return; fi
  here=$(cd "$(dirname "$1")/.." && pwd)
  if [ -f "$here/examples/launch_common.sh" ]; then echo "$here"; return; fi
  if [ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/examples/launch_common.sh" ]; then
    echo "$SLURM_SUBMIT_DIR"; return
  fi
  dapo_die "cannot find the repository root (set DAPO_ROOT, or submit from the repository root)"
}

# A value of the calling script's #SBATCH header (the defaults), e.g. `dapo_header nodes`.
dapo_header() {
  sed -n "s/^#SBATCH --$1=\([^ ]*\).*/\1/p" "$SCRIPT" | head -n1
}

dapo_in_allocation() { [ -n "${SLURM_JOB_ID:-}" ]; }

# Leading flags -> variables; the rest are dotted overrides, left in DAPO_OVERRIDES.
dapo_parse_flags() {
  DAPO_OVERRIDES=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) NODES=$2; shift 2 ;;
      --gpus-per-node) GPUS_PER_NODE=$2; shift 2 ;;
      --tasks-per-node) TASKS_PER_NODE=$2; shift 2 ;;
      --time) WALLTIME=$2; shift 2 ;;
      --job-name) JOB_NAME=$2; shift 2 ;;
      --output) OUTPUT=$2; shift 2 ;;
      --partition) PARTITION=$2; shift 2 ;;
      --account) ACCOUNT=$2; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --nodes=*|--gpus-per-node=*|--tasks-per-node=*|--time=*|--job-name=*|--output=*|--partition=*|--account=*)
        set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
      -h|--help) sed -n '2,/^set -/p' "$SCRIPT" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
      --) shift; DAPO_OVERRIDES+=("$@"); break ;;
      *) DAPO_OVERRIDES+=("$1"); shift ;;
    esac
  done
}

# Print a command as one copy-pasteable line (words with shell-special characters quoted).
dapo_show() {
  local w line=" "
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,%+@-]+$ ]]; then line+=" $w"; else line+=" $(printf '%q' "$w")"; fi
  done
  echo "$line"
}

dapo_sbatch_cmd() {
  # shellcheck disable=SC2054  # the comma in --export=ALL,... is sbatch syntax
  DAPO_SBATCH=(sbatch --parsable --job-name="$JOB_NAME" --nodes="$NODES" --ntasks-per-node="$TASKS_PER_NODE"
               --cpus-per-task="$CPUS_PER_TASK" --time="$WALLTIME" --output="$OUTPUT" --open-mode=append
               --requeue --chdir="$DAPO_ROOT" --export=ALL,DAPO_ROOT="$DAPO_ROOT")
  if [ "${GPUS_PER_NODE:-0}" -gt 0 ]; then DAPO_SBATCH+=(--gpus-per-node="$GPUS_PER_NODE"); fi
  if [ -n "${PARTITION:-}" ]; then DAPO_SBATCH+=(--partition="$PARTITION"); fi
  if [ -n "${ACCOUNT:-}" ]; then DAPO_SBATCH+=(--account="$ACCOUNT"); fi
  DAPO_SBATCH+=("${SBATCH_EXTRA[@]}")
  # shellcheck disable=SC2206  # SBATCH_ARGS is split on blanks on purpose
  if [ -n "${SBATCH_ARGS:-}" ]; then DAPO_SBATCH+=($SBATCH_ARGS); fi
  DAPO_SBATCH+=("$SCRIPT" "${DAPO_OVERRIDES[@]}")
}

dapo_train_cmd() {
  DAPO_TRAIN=("$PYTHON" -m megatron_dapo.train --config "$CONFIG" "${TRAIN_ARGS[@]}" "${DAPO_OVERRIDES[@]}")
}

dapo_srun_cmd() {  # nodes tasks_per_node
  DAPO_SRUN=(srun --kill-on-bad-exit=1 --label --nodes="$1" --ntasks-per-node="$2" --ntasks="$(($1 * $2))"
             --cpus-per-task="$CPUS_PER_TASK")
  # every task sees all GPUs of its node (the trainer picks LOCAL_RANK; a node leader's SGLang servers use
  # several): --gpu-bind=none overrides a site's default of one GPU per task (SLURM_GPU_BIND, cli_filter)
  if [ "${GPUS_PER_NODE:-0}" -gt 0 ]; then DAPO_SRUN+=(--gpus-per-node="$GPUS_PER_NODE" --gpu-bind=none); fi
  DAPO_SRUN+=("${SRUN_EXTRA[@]}")
}

dapo_plan() {  # world geometry for the planner
  [ "${PLAN:-0}" = 1 ] || return 0
  local cmd=("$PYTHON" -m megatron_dapo.plan --config "$CONFIG" --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE"
             --gpu-mem-gb "${GPU_MEM_GB:-80}" "${TRAIN_ARGS[@]}" "${DAPO_OVERRIDES[@]}")
  dapo_log "planner:"
  dapo_show "${cmd[@]}"
  "${cmd[@]}"
}

dapo_config_check() {  # world size
  local cmd=("$PYTHON" -m megatron_dapo.train --config "$CONFIG" --world-size "$1" --dry-run
             "${TRAIN_ARGS[@]}" "${DAPO_OVERRIDES[@]}")
  dapo_log "trainer config check (resolved config follows):"
  dapo_show "${cmd[@]}"
  "${cmd[@]}"
}

dapo_log_path() {  # job id -> the log file (%x = job name, %j = job id)
  local p=${OUTPUT//%j/$1}
  echo "${p//%x/$JOB_NAME}"
}

dapo_submit() {
  local out job
  dapo_sbatch_cmd
  if [ "${DRY_RUN:-0}" = 1 ]; then
    dapo_log "DRY_RUN: outside an allocation this submits:"
    dapo_show "${DAPO_SBATCH[@]}"
    dapo_log "DRY_RUN: inside the allocation it then runs:"
    dapo_show_inside "$NODES" "$TASKS_PER_NODE"
    dapo_plan || return $?
    dapo_config_check $((NODES * TASKS_PER_NODE))
    return $?
  fi
  command -v sbatch >/dev/null || dapo_die "no sbatch on PATH: LAUNCH=slurm submits through Slurm (run it on a login node), LAUNCH=local runs here"
  if declare -F dapo_presubmit >/dev/null; then dapo_presubmit || return $?; fi
  if ! dapo_plan; then
    dapo_log "the planner refused this layout: not submitted (PLAN=0 skips the planner)"
    return 1
  fi
  mkdir -p "$(dirname "$OUTPUT")"  # Slurm does not create the log's folder
  out=$("${DAPO_SBATCH[@]}") || dapo_die "sbatch failed: ${DAPO_SBATCH[*]}"
  job=${out%%;*}
  dapo_log "submitted job $job ($NODES node(s) x $TASKS_PER_NODE tasks); log: $(dapo_log_path "$job")"
  dapo_log "watch: squeue -j $job; tail -f $(dapo_log_path "$job")"
  echo "$job"
}

dapo_show_inside() {  # nodes tasks_per_node
  # shellcheck disable=SC2016  # printed for the reader, not expanded
  echo '  export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=<a free port>'
  if [ ${#RUN_ENV[@]} -gt 0 ]; then dapo_show export "${RUN_ENV[@]}"; fi
  if declare -F dapo_prepare_show >/dev/null; then dapo_prepare_show; fi
  dapo_srun_cmd "$1" "$2"
  dapo_train_cmd
  dapo_show "${DAPO_SRUN[@]}" "${DAPO_TRAIN[@]}"
  if declare -F dapo_after_show >/dev/null; then dapo_after_show; fi
}

dapo_free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((20000 + ${SLURM_JOB_ID:-0} % 20000))
}

# Inside the allocation: geometry from Slurm, rendezvous env, then srun the trainer.
dapo_inside() {
  local nodes tasks rc
  nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  tasks=${SLURM_NTASKS_PER_NODE:-}
  if [ -z "$tasks" ]; then tasks=$(( ${SLURM_NTASKS:-$TASKS_PER_NODE} / nodes )); fi
  if [ "$tasks" -lt 1 ]; then tasks=1; fi
  NODES=$nodes
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}; fi  # "h100:8" -> 8
  if [ "${DRY_RUN:-0}" = 1 ]; then
    dapo_log "DRY_RUN: inside job ${SLURM_JOB_ID}; would run:"
    dapo_show_inside "$nodes" "$tasks"
    dapo_plan || return $?
    dapo_config_check $((nodes * tasks))
    return $?
  fi
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1)
  export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  export MASTER_PORT=${MASTER_PORT:-$(dapo_free_port)}
  if [ ${#RUN_ENV[@]} -gt 0 ]; then export "${RUN_ENV[@]}"; fi
  dapo_log "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}: $nodes node(s) x $tasks" \
           "tasks, MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT, root $DAPO_ROOT"
  # a config error fails here in a second (no torch import), before any conversion or build
  rc=0
  "$PYTHON" -m megatron_dapo.config --config "$CONFIG" --world-size $((nodes * tasks)) \
      "${TRAIN_ARGS[@]}" "${DAPO_OVERRIDES[@]}" >/dev/null || rc=$?
  if [ "$rc" -ne 0 ]; then dapo_log "invalid config: not started (exit $rc)"; return "$rc"; fi
  if declare -F dapo_prepare >/dev/null; then
    dapo_prepare || { rc=$?; dapo_log "preparation failed (exit $rc)"; return "$rc"; }
  fi
  dapo_srun_cmd "$nodes" "$tasks"
  dapo_train_cmd
  dapo_log "running:"
  dapo_show "${DAPO_SRUN[@]}" "${DAPO_TRAIN[@]}"
  # srun runs in the background so that the USR1 trap can run meanwhile. SIGUSR1 (`#SBATCH
  # --signal=B:USR1@T`: the time limit is T seconds away) goes on to the trainer (srun forwards it to
  # every rank), which finishes its step, saves it and exits; then the job is requeued, and
  # checkpoint.resume=auto continues it from that checkpoint.
  local pid="" preempted=0
  trap 'preempted=1; dapo_log "SIGUSR1 (time limit near): the trainer saves its step and stops";
        [ -n "$pid" ] && kill -USR1 "$pid" 2>/dev/null' USR1
  "${DAPO_SRUN[@]}" "${DAPO_TRAIN[@]}" &
  pid=$!
  while :; do
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break  # wait was interrupted by a trap: keep waiting
  done
  trap - USR1
  dapo_log "trainer exited with status $rc"
  if [ "$rc" -eq 0 ] && [ "$preempted" = 0 ] && declare -F dapo_after >/dev/null; then dapo_after || rc=$?; fi
  if [ "$preempted" = 1 ]; then
    dapo_log "requeueing job $SLURM_JOB_ID: checkpoint.resume=auto continues it"
    scontrol requeue "$SLURM_JOB_ID" || dapo_log "scontrol requeue failed: resubmit the job to continue"
  fi
  return "$rc"
}

# Entry point: DAPO_ROOT, defaults from the #SBATCH header, flags, then submit or run.
dapo_launch() {
  dapo_parse_flags "$@"
  PYTHON=${PYTHON:-python}
  JOB_NAME=${JOB_NAME:-$(dapo_header job-name)}
  NODES=${NODES:-$(dapo_header nodes)}
  GPUS_PER_NODE=${GPUS_PER_NODE:-$(dapo_header gpus-per-node)}
  GPUS_PER_NODE=${GPUS_PER_NODE:-0}
  TASKS_PER_NODE=${TASKS_PER_NODE:-$(dapo_header ntasks-per-node)}
  if [ "$GPUS_PER_NODE" -gt 0 ]; then TASKS_PER_NODE=${TASKS_PER_NODE:-$GPUS_PER_NODE}; fi
  TASKS_PER_NODE=${TASKS_PER_NODE:-1}
  CPUS_PER_TASK=${CPUS_PER_TASK:-$(dapo_header cpus-per-task)}
  CPUS_PER_TASK=${CPUS_PER_TASK:-1}
  WALLTIME=${WALLTIME:-$(dapo_header time)}
  WALLTIME=${WALLTIME:-UNLIMITED}
  LOG_DIR=${LOG_DIR:-logs}
  OUTPUT=${OUTPUT:-$LOG_DIR/%x-%j.out}
  [[ "$OUTPUT" = /* ]] || OUTPUT="$DAPO_ROOT/$OUTPUT"
  if [ -z "${SBATCH_EXTRA+x}" ]; then SBATCH_EXTRA=(); fi
  if [ -z "${SRUN_EXTRA+x}" ]; then SRUN_EXTRA=(); fi
  if [ -z "${RUN_ENV+x}" ]; then RUN_ENV=(); fi
  if [ -z "${TRAIN_ARGS+x}" ]; then TRAIN_ARGS=(); fi
  cd "$DAPO_ROOT" || dapo_die "cannot cd to $DAPO_ROOT"
  if dapo_in_allocation; then dapo_inside; else dapo_submit; fi
}
