"""The converters and the config mapping against the real Megatron-core (when it is installed:
the ``megatron`` extra), on two gloo CPU ranks with tensor parallelism 2 (see
megatron_cpu_check.py for the three CUDA-only calls it patches in its own processes).

Tolerance: both models compute in float32 with a different order of operations (fused QKV,
Megatron's RMSNorm and rotary code); over 2 layers of width 32 with logits of magnitude ~5 the
differences are a few float32 ulps of the activations (~1e-6). 1e-4 leaves a wide margin and
still catches any layout error (a swapped head or gate/up half moves logits by O(1))."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")


@pytest.mark.slow
def test_real_megatron_gpt_matches_hf_for_every_family_with_tp2():
    script = Path(__file__).with_name("megatron_cpu_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {line.split()[1]: (float(line.split()[2]), float(line.split()[3]))
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    assert set(results) == {"qwen2-tied", "qwen2", "qwen3", "qwen3_moe"}, proc.stdout
    for family, (logit_diff, lp_diff) in results.items():
        assert logit_diff < 1e-4, (family, logit_diff)
        assert lp_diff < 1e-4, (family, lp_diff)
