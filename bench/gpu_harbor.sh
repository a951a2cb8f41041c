#!/bin/bash
# Harbor against vLLM on one H200 (issue "GPU runs on one H200", run 8): `ferryman train
# examples/harbor/train.yaml` with the engine switched to vLLM and the trainer to the GPU.
# Harbor Trials (ShellAgent, Docker-free namespace sandboxes built from each task's Dockerfile)
# talk to the proxy, which serves them from the vLLM replica and records tokens, masks and
# log-probs; the FSDP2 trainer trains them; new weights go back over CUDA IPC. One command:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_harbor.sh [dotted overrides ...]
#
# WHEEL_DIR must hold the vllm set *with* Harbor and LiteLLM
# (`tools/gpu_wheels.py download --extra vllm --with harbor --with litellm`). The sandbox needs
# root and Linux namespaces: the script checks both first and stops (exit 4) when they are missing.
# The project's H200 machine gives its processes a cgroup v2 without the cpu and pids controllers;
# the sandbox then makes its cgroups under the lowest ancestor that has them (there: the root), so
# the run is contained as configured (bench/results/gpu_one_gpu.md, "Run 8 contained").
# env.environment.kwargs.enforce_limits=false runs without limits where no cgroup can give them.
# $OUT gets: report.txt (what was recorded and trained), metrics.jsonl, summary.json, train.log.gz.
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
python3 -c "import harbor, litellm" 2>/dev/null || { echo "harbor or litellm is not installed (carry them: --with harbor --with litellm)"; exit 4; }
if ! unshare --net --mount --pid --fork --mount-proc true 2>"$WORK/unshare.err"; then
  echo "no Linux namespaces here (the sandbox needs them): $(cat "$WORK/unshare.err")"; exit 4
fi
RUN=$WORK/harbor_vllm
rm -rf "$RUN"
T=${T:-360}
timeout -s INT "$T" "${FERRYMAN[@]}" train examples/harbor/train.yaml "run_dir=$RUN" \
  "model.path=$WORK/qwen2.5-0.5b-random-2k" model.tiny_preset=qwen2.5-0.5b model.tiny_dtype=bfloat16 \
  ray_num_gpus=1 ray.trainer.num_gpus=0.5 rollout.num_gpus_per_replica=0.4 \
  'engine={type: vllm, core: thread, dtype: bfloat16, gpu_memory_utilization: 0.15, kv_cache_memory_bytes: 2147483648, max_model_len: 2048, enforce_eager: true, sleep_mode: false}' \
  trainer.device=cuda trainer.backend=nccl trainer.param_dtype=bfloat16 trainer.lr=1e-5 \
  weight_sync.type=cuda_ipc training.total_steps=10 training.mismatch_kl_every=1 "$@" \
  > "$WORK/train.log" 2>&1
rc=$?
echo "ferryman train exited with $rc"; tail -5 "$WORK/train.log"
cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$OUT/" 2>/dev/null
python3 - "$RUN" <<'EOF' | tee "$OUT/report.txt"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
path = run / "metrics.jsonl"
rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
print(f"run: {run}; trainer steps: {len(rows)}")
if not rows:
    sys.exit(0)
last = rows[-1]
def mean(key):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None
for key in sorted(k for k in last if k.startswith("harbor/")):
    print(f"  {key}: {last[key]}")
for key in ("harbor/trial_s", "harbor/agent_setup_s", "harbor/agent_execution_s", "harbor/verifier_s", "harbor/environment_setup_s"):
    m = mean(key)
    if m is not None:
        print(f"  mean {key}: {m:.3f}")
for key in ("mismatch/abs_diff_mean", "response/length_mean", "reward/mean", "sync/generation_pause_s", "perf/samples_per_s_avg"):
    m = mean(key)
    print(f"  mean {key}: {m if m is None else round(m, 5)}")
syncs = sum(1 for r in rows if "sync/version" in r)
print(f"  weight syncs: {syncs}")
# the recorded trajectories: tokens with a mask and a log-prob for every model token
trace = run / "trace"
print("  trace files:", sorted(p.name for p in trace.iterdir())[:8] if trace.is_dir() else "none")
EOF
gzip -c "$WORK/train.log" > "$OUT/train.log.gz"
exit $rc
