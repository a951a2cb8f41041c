# Sourced on the project's GPU machine (no internet): installs the locked wheels that
# tools/gpu_wheels.py packed (gathered, folder by folder, into $WHEELS), then the workspace
# packages from this checkout, and sets the environment vLLM 0.24 needs there (tools/gpu-install.sh).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
WHEELS=${WHEELS:-/root/w}
install_vllm() {
  # shellcheck source=/dev/null
  source "$ROOT/tools/gpu-install.sh" "$WHEELS"
}
