"""The fixed parts of the batch script (bash). They read only Slurm's variables and the run variables that
slurm/script.py renders above them (PYTHON, NPROC_PER_NODE, REQUEUE, MAX_FAILURES, TRAIN, OUT_DIR, POINT); no user
text is pasted into them. How a stop reaches the training processes was measured on Slurm 22.05 with torch 2.13's
torchrun and is explained in the script's own comment above its traps and in slurm/agent.py."""

PRELUDE = r"""set -o pipefail
log() { echo "[megaloop-job $(date '+%F %T')] $*"; }
"""

RENDEZVOUS = r"""# Rendezvous: torchrun's c10d store on the first node of the allocation, on a port derived from the job id so
# that jobs sharing a node do not collide.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT"""

NCCL = r"""# NCCL / InfiniBand defaults for H100 clusters. Each keeps a value already in the environment (sbatch passes the
# submitting shell's environment on), so `export NCCL_SOCKET_IFNAME=ib0` before sbatch, or --env, overrides it.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}          # use InfiniBand / RoCE (GPUDirect RDMA) when present
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}              # a failed or timed-out collective
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # aborts its process, no hang
# export NCCL_SOCKET_IFNAME=ib0   # NCCL's bootstrap interface, when the nodes have several (e.g. ib0, bond0)
# NCCL flight recorder: each rank keeps its last collectives in a ring buffer and, when the watchdog sees a collective
# time out (parallel.timeout_s; a hung rank shows only this way), dumps it to $OUT_DIR/nccl_trace/rank_<N>, so the
# rank that stopped calling collectives can be named afterwards. Values already in the environment are kept.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
if [ -z "${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}" ]; then
  mkdir -p "$OUT_DIR/nccl_trace" && export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$OUT_DIR/nccl_trace/rank_"
fi
# CUDA caching allocator: expandable segments grow one mapping instead of caching blocks of every size the loop's
# shrinking active prefix and fresh depths ask for (less fragmentation, fewer out-of-memory stops at a high
# reserved/allocated ratio). A value already set is kept.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"""

DEADLINE_AND_TRAP = r"""# The job's end time: the trainer saves and stops before it (MEGALOOP_DEADLINE, a unix time, 60 s left for the
# requeue) even when the USR1 of --signal comes late or not at all.
END_TIME=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | head -n 1)
if [[ $END_TIME =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T ]] && END_S=$(date -d "$END_TIME" +%s 2>/dev/null); then
  export MEGALOOP_DEADLINE=$((END_S - 60))
fi

# Stops. `--signal=B:USR1@LEAD` and `scancel --signal=USR1 --batch JOB` signal this shell only (srun and the
# training processes see nothing): the trap forwards USR1 to srun, which delivers it to EVERY process of the training
# step on every node, each torchrun agent and each worker. Cancellation, preemption and the time limit: Slurm itself
# sends SIGTERM to every process of every step (then SIGKILL after the cluster's KillWait), so TERM is not forwarded:
# a second signal makes the trainer abort instead of save. Plain torchrun would die of USR1 and would answer TERM by
# signalling its workers once more; `python -m slurm.agent` runs torchrun leaving both signals to the workers. Each
# worker gets exactly one, they agree on one step, save a checkpoint and exit 75 (torchrun itself then exits 1, so
# the outcome is read from the markers the trainer writes: COMPLETED -> done; STOPPED -> `scontrol requeue`, unless
# the stop came with SIGTERM: cancelled, or preempted and requeued by Slurm itself, or the marker says
# "requeue": false: a loss spike that needs a person; neither -> a failure). bash runs a trap only after the
# foreground command returns, so srun runs in the background and the script waits for it.
STEP_PID=""
STOP_SIGNAL=""
CANCELLED=""
TRAPPED=0
on_usr1() {
  TRAPPED=1
  if [ -n "$STOP_SIGNAL" ]; then log "USR1 again: ignored, the stop is under way"; return; fi
  STOP_SIGNAL=USR1
  log "USR1: every training process stops at the next step, saves a checkpoint and the job requeues"
  if [ -n "$STEP_PID" ]; then kill -USR1 "$STEP_PID" 2>/dev/null; fi
}
on_term() {
  TRAPPED=1
  CANCELLED=1
  log "TERM (cancel, preemption or time limit): Slurm signals the training processes itself; they save and stop"
}
trap on_usr1 USR1
trap on_term TERM

"""

LAUNCH_HEAD = r"""# Launch: one torchrun per node (srun), in the background, then wait for it.
step_of() { sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$1" 2>/dev/null; }
startup_of() { grep -o '"during": *"start-up"' "$1" 2>/dev/null; }  # a stop before the first step
PREVIOUS_STOP=$(step_of "$OUT_DIR/STOPPED")  # the step the previous job of this run stopped at, if it did
PREVIOUS_STARTUP=$(startup_of "$OUT_DIR/STOPPED")
rm -f "$OUT_DIR/COMPLETED" "$OUT_DIR/STOPPED"
STEP_START=$(date +%s)  # failures recorded from here on are this job's (slurm/failures.py)
log "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s) ${SLURM_JOB_NODELIST}," \
    "${NPROC_PER_NODE} processes per node, rendezvous ${MASTER_ADDR}:${MASTER_PORT}, out_dir ${OUT_DIR}"
if [ -n "$STOP_SIGNAL$CANCELLED" ]; then
  log "stopped before training started"
  if [ -z "$CANCELLED" ] && [ "$REQUEUE" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
  exit 0
fi"""

LAUNCH_TAIL = r"""STEP_PID=$!
while :; do
  TRAPPED=0
  wait "$STEP_PID"
  RC=$?
  if [ "$TRAPPED" = 0 ] || [ "$RC" -lt 128 ]; then break; fi
done
log "training step ended with exit code $RC"

"""

OUTCOME = r"""# Outcome, from the trainer's markers in its out_dir.
if [ -f "$OUT_DIR/COMPLETED" ]; then
  log "training completed: $(cat "$OUT_DIR/COMPLETED")"
  exit 0
fi
if [ -f "$OUT_DIR/STOPPED" ]; then
  if grep -q '"requeue": *false' "$OUT_DIR/STOPPED"; then  # e.g. a loss spike under train.on_spike=stop
    log "stopped and not to be requeued ($(cat "$OUT_DIR/STOPPED")): the run needs a person; submit the same job" \
        "again to continue from its newest checkpoint once the cause is dealt with"
    exit 75
  fi
  if [ -n "$CANCELLED" ]; then
    log "stopped and saved after SIGTERM: not requeued by this script (submit again to continue)"
    exit 0
  fi
  if [ "$REQUEUE" != 1 ]; then
    log "stopped and saved: this segment is done; the next job of the chain continues"
    exit 0
  fi
  if [ -n "$PREVIOUS_STARTUP" ] && [ "$(step_of "$OUT_DIR/STOPPED")" = "$PREVIOUS_STOP" ]; then
    log "stopped at step $PREVIOUS_STOP again, with no progress since the previous job stopped during start-up:" \
        "not requeueing (a longer --time or a later stop would let it train)"
    exit 75
  fi
  log "stopped and saved ($(cat "$OUT_DIR/STOPPED")): requeueing job ${SLURM_JOB_ID}"
  if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
  log "scontrol requeue failed: submit the same job again to continue from its checkpoint"
  exit 75
fi
# Neither: the training failed. slurm.agent restarted failed workers in place (torchrun --max-restarts) until it gave
# up, or the whole step died (a lost node, a killed agent). Every failure of the run is counted in
# $OUT_DIR/failures.jsonl, in-job restarts and requeues alike: below MAX_FAILURES within an hour this job requeues
# itself and resumes from the newest committed checkpoint; the MAX_FAILURES-th ends it FAILED with the reason in one
# line, the checkpoints untouched. Slurm refuses ExcNodeList on a running job and a requeue ends this script at once,
# so no node is excluded here (Slurm does not allocate a node it found failed again).
if [ -n "$CANCELLED" ]; then
  log "training failed after SIGTERM (cancel, preemption or time limit) without saving: not requeued by this" \
      "script; submit again to resume from the last committed checkpoint"
  exit 1
fi
VERDICT=$("$PYTHON" -m slurm.failures step-ended "$OUT_DIR/failures.jsonl" --max-failures "$MAX_FAILURES" \
    --since "$STEP_START" --exit-code "$RC")
case "$VERDICT" in
  "requeue "*|"fail "*) ;;
  *) VERDICT="fail python -m slurm.failures gave no verdict; submit the job again to resume from the last checkpoint" ;;
esac
if [ "${VERDICT%% *}" = requeue ] && [ "$REQUEUE" = 1 ]; then
  log "training failed: ${VERDICT#* }; requeueing job ${SLURM_JOB_ID} to resume from the newest committed checkpoint"
  if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
  log "scontrol requeue failed: submit the same job again to continue from its checkpoint"
elif [ "${VERDICT%% *}" = requeue ]; then
  log "training failed: ${VERDICT#* }; this segment is done, the next job of the chain continues"
else
  log "training failed: ${VERDICT#* }"
fi
if [ "$RC" = 0 ]; then exit 1; fi
exit "$RC"
"""
