"""The real Megatron-core on the CPU (when it is installed: the ``megatron`` extra; the nox
session ``trainer_megatron`` installs it), each check in its own processes because
megatron_cpu_patches.py patches Megatron's CUDA-only calls process-wide:

- the converters and the config mapping: two gloo ranks with tensor parallelism 2, logits and
  vocab-parallel log-probs equal HF's for every family (megatron_cpu_check.py);
- the generic TrainerContract (with a critic and GAE) on the real ``MegatronRuntime``, one rank
  (megatron_cpu_contract.py);
- the runtime on two ranks at tensor parallel 2, pipeline parallel 2, context parallel 2 and
  data parallel 2:
  log-probs equal HF's, the exported weights are HF's, an update changes them, a
  ``dist_checkpointing`` round trip restores weights and optimizer, and a checkpoint of the
  previous layout loads and takes the same next step; a critic on each layout gives its value
  head over HF's hidden states (megatron_cpu_runtime.py);
- context parallel 2 against data parallel 2 on longer rows: log-probs equal HF's, the same
  PPO step (megatron_cp_check.py);
- Qwen3-MoE at expert parallel 2 with router replay, also with context parallel 2
  (megatron_cpu_moe.py).

Tolerance: both models compute in float32 with a different order of operations (fused QKV,
Megatron's RMSNorm and rotary code); over 2 layers of width 32 with logits of magnitude ~5 the
differences are a few float32 ulps of the activations (~1e-6). 1e-4 leaves a wide margin and
still catches any layout error (a swapped head or gate/up half moves logits by O(1))."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _torchrun(script: str, nproc: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(HERE / script)],
        capture_output=True, text=True, timeout=400, env={**ENV, **env},
    )


@pytest.mark.slow
def test_real_megatron_gpt_matches_hf_for_every_family_with_tp2():
    proc = _torchrun("megatron_cpu_check.py", 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {line.split()[1]: tuple(float(x) for x in line.split()[2:5])
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    assert set(results) == {"qwen2-tied", "qwen2", "qwen3", "qwen3_moe"}, proc.stdout
    for family, (logit_diff, lp_diff, sdpa_diff) in results.items():
        assert logit_diff < 1e-4, (family, logit_diff)
        assert lp_diff < 1e-4, (family, lp_diff)
        assert sdpa_diff < 1e-4, (family, sdpa_diff)  # the SDPA core attention: HF's logits too


@pytest.mark.slow
def test_trainer_contract_on_the_real_runtime(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", f"--basetemp={tmp_path}",
         str(HERE / "megatron_cpu_contract.py")],
        capture_output=True, text=True, timeout=600, env=ENV,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    # every contract test ran and passed on the real runtime (none skipped)
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s( \([\d:]+\))?", summary), proc.stdout[-2000:]


@pytest.mark.slow
def test_runtime_on_two_ranks_tp_pp_dp_and_resume_on_another_layout(tmp_path):
    # TP 2, then PP 2, then CP 2, then DP 2 on two ranks; each also loads the previous layout's
    # checkpoint and must take the same next step (dist_checkpointing reshards between layouts)
    layouts = [{"CHECK_TP": "2"}, {"CHECK_PP": "2"}, {"CHECK_CP": "2"}, {}]
    for i, layout in enumerate(layouts):
        env = {**layout, "CHECK_HANDOFF": str(tmp_path / f"h{i}")}
        (tmp_path / f"h{i}").mkdir()
        if i:
            env["CHECK_RESUME_FROM"] = str(tmp_path / f"h{i - 1}")
        proc = _torchrun("megatron_cpu_runtime.py", 2, **env)
        assert proc.returncode == 0, (layout, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert "RESULT ok" in proc.stdout, proc.stdout[-2000:]
        if i:
            prev = ["tp2-pp1-cp1-dp1", "tp1-pp2-cp1-dp1", "tp1-pp1-cp2-dp1"][i - 1]
            assert f"RESULT resumed {prev}" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_context_parallel_step_equals_the_data_parallel_step():
    # CP 2 then DP 2 on the same two ranks, rows of up to ~170 tokens (the GPU test runs the
    # same script on two GPUs, with Transformer Engine's attention as well)
    proc = _torchrun("megatron_cp_check.py", 2, CP_DEVICE="cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT local " in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("cp", ["1", "2"])
def test_moe_expert_parallel_with_router_replay(cp):
    # cp 2: the sequence split over the same two ranks too (routers see their own positions)
    proc = _torchrun("megatron_cpu_moe.py", 2, CHECK_CP=cp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ok")), None)
    assert line is not None, proc.stdout[-2000:]
    replayed_diff, moved = float(line.split()[2]), float(line.split()[3])
    assert replayed_diff < 1e-4 and moved > 1e-2, line


@pytest.mark.slow
def test_same_log_probs_and_ppo_step_as_the_fsdp_backend():
    pytest.importorskip("ferryman_trainer_fsdp", reason="compares with trainer-fsdp")
    proc = _torchrun("megatron_cpu_parity.py", 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(x.startswith("RESULT ") for x in proc.stdout.splitlines()), proc.stdout[-2000:]
