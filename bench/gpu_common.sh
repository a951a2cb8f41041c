# Sourced by bench/gpu_e2e.sh and bench/gpu_modes.sh on the project's GPU machine (no internet):
# the settings the GPU stack needs there (packages/engine-vllm/tools/gpu_env.sh has the story of
# each), the locked wheels and this checkout's packages installed by tools/gpu-install.sh from
# WHEEL_DIR (default /root/w, where the .gpuwheels folders were copied), $OUT and $WORK.
# FERRYMAN_SKIP_INSTALL=1: use what is installed, with this checkout's sources on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/runs/gpu-out}
mkdir -p "$OUT"
WHEEL_DIR=${WHEEL_DIR:-/root/w}
WORK=${WORK:-/tmp/ferryman-gpu}
mkdir -p "$WORK"
if [ -z "${FERRYMAN_SKIP_INSTALL:-}" ]; then
  # the locked wheels (once) and this checkout's packages (every call, with their entry points);
  # sourced, so that its PYTHONPATH and settings stay here
  # shellcheck disable=SC1091
  source "$ROOT/tools/gpu-install.sh" "$WHEEL_DIR" || { echo "tools/gpu-install.sh $WHEEL_DIR failed" >&2; exit 3; }
else
  # the stack is installed already: this checkout's sources, their plugin hooks named
  for pkg in core engine-hf engine-vllm trainer-fsdp sync-nccl router; do
    PYTHONPATH="$ROOT/packages/$pkg/src${PYTHONPATH:+:$PYTHONPATH}"
  done
  export PYTHONPATH
  export FERRYMAN_PLUGINS=ferryman_engine_hf.hooks,ferryman_engine_vllm.hooks,ferryman_trainer_fsdp.hooks,ferryman_sync_nccl.hooks,ferryman_router.hooks
fi
FERRYMAN=(python3 -m ferryman.cli)
# what the machine is, once, for the record
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # the engines' packages that this site has (the SGLang set has no vLLM, and the other way round)
  python3 -c "
import importlib.metadata as m
for name in ('torch', 'vllm', 'sglang', 'megatron-core', 'ray', 'transformers'):
    try:
        print(name, m.version(name), end='  ')
    except m.PackageNotFoundError:
        pass
print()"
} > "$WORK/machine.txt" 2>&1

# Time limits that hold for a whole process tree. A command started by `run_limited` runs in a
# session of its own (setsid); Ray's raylet, GCS and workers, which a driver's local Ray starts,
# stay in that session, though each worker has a process group of its own (so `kill -- -PGID` of
# the driver's group alone leaves them running, holding the GPU).
#
#   run_limited LIMIT_S SIGNAL GRACE_S LOG CMD...
#
# runs CMD (output appended to LOG); when it is still running after LIMIT_S seconds, sends SIGNAL
# to CMD itself (INT: stop; TERM: ferryman saves a checkpoint at the next sync and exits 75; not
# to its process group, which holds the local Ray's GCS and raylet that the checkpoint still
# needs), and after GRACE_S more seconds SIGKILLs every process left in its session; then waits
# until none is left. Returns CMD's exit status, or 124 when it was stopped at the limit and had
# not exited by itself within the grace (then the status it gave is lost); RUN_LIMITED_HIT=1
# when the limit was reached.
session_pids() { ps -eo pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ {print $1}'; }  # zombies are dead already
kill_session() {
  local sid=$1 i pids
  for i in $(seq 60); do
    pids=$(session_pids "$sid")
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
    sleep 0.5
  done
  echo "kill_session $sid: processes still there: $(session_pids "$sid" | tr '\n' ' ')" >&2
  return 1
}
run_limited() {
  local limit=$1 sig=$2 grace=$3 log=$4 pid t0 rc=""
  shift 4
  RUN_LIMITED_HIT=0  # set to 1 when CMD was still running at the limit
  # not a process-group leader here (no job control in a script), so setsid runs CMD in this
  # very process: $! is CMD's pid and its session's id. A script's background job starts with
  # SIGINT and SIGQUIT ignored (POSIX), and Python keeps an ignored SIGINT: the driver never saw
  # the SIGINT sent at the limit and was SIGKILLed 30 s later (the 2026-12-03 runs). So CMD is
  # exec'ed with both back to their defaults (the pid stays the same).
  setsid python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' "$@" >> "$log" 2>&1 < /dev/null &
  pid=$!
  t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && (( SECONDS - t0 < limit )); do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    RUN_LIMITED_HIT=1
    echo "run_limited: $(basename "$1") still running after ${limit}s: SIG$sig" | tee -a "$log" >&2
    kill -s "$sig" "$pid" 2>/dev/null  # the driver only: its process group holds Ray's GCS and raylet too
    t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - t0 < grace )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "run_limited: no exit ${grace}s after SIG$sig: SIGKILL to its session" | tee -a "$log" >&2
      rc=124
    fi
  fi
  kill_session "$pid"
  wait "$pid"
  local got=$?
  return "${rc:-$got}"
}
