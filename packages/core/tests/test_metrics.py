"""The numbers every run reports, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ferryman import metrics as fm
from ferryman.runner import GeneratedTokens
from ferryman.types import Sample, TokenOutput, Trajectory


def test_abs_diff_mean_is_over_fresh_model_tokens_only():
    # one row, 5 positions: mask 1 at 0, 1, 2, 4; versions 3, 3, 2, (mask 0), 3; current version 3
    rollout = torch.tensor([[-1.0, -2.0, -0.5, 0.0, -3.0]])
    trainer = torch.tensor([[-1.5, -1.0, -4.0, -9.0, -3.25]])
    mask = torch.tensor([[1, 1, 1, 0, 1]])
    versions = torch.tensor([[3, 3, 2, -1, 3]])
    m = fm.mismatch_metrics(rollout, trainer, mask, versions, version=3)
    # fresh tokens: positions 0, 1, 4: |−0.5|, |1.0|, |−0.25| → 1.75 / 3
    assert m["mismatch/abs_diff_mean"] == pytest.approx(1.75 / 3, rel=1e-6)
    # k1 over every masked token: d = -0.5, 1.0, -3.5, -0.25 → mean(-d) = 3.25 / 4
    assert m["mismatch/kl_k1"] == pytest.approx(3.25 / 4, rel=1e-6)
    k3 = [math.expm1(d) - d for d in (-0.5, 1.0, -0.25)]
    assert m["mismatch/kl_k3_fresh"] == pytest.approx(sum(k3) / 3, rel=1e-5)


def test_abs_diff_mean_absent_without_fresh_tokens():
    t = torch.tensor([[-1.0, -2.0]])
    m = fm.mismatch_metrics(t, t - 1, torch.tensor([[1, 1]]), torch.tensor([[0, 1]]), version=2)
    assert "mismatch/abs_diff_mean" not in m and "mismatch/kl_k3_stale" in m


def _traj(versions: list[int], aborts: int = 0, glue: int = 0) -> Trajectory:
    t = Trajectory(request_id="r", prompt_ids=[1])
    t.append_model_tokens(TokenOutput(list(range(len(versions))), [-1.0] * len(versions), list(versions), num_aborts=aborts))
    if glue:
        t.append_observation([0] * glue)
    return t


def test_partial_share_counts_samples_resumed_across_a_sync():
    samples = [
        Sample("a", 0, [_traj([1, 1, 1]), _traj([1, 1])]),  # one version, no abort: not resumed
        Sample("b", 1, [_traj([1, 1, 2], aborts=1), _traj([1])]),  # aborted and resumed at v2
        Sample("c", 2, [_traj([2, 2], glue=3), _traj([1, 2])]),  # kept across a pause (no abort)
        Sample("d", 3, [_traj([0, 0, 0], aborts=0)]),  # old but one version: stale, not resumed
    ]
    m = fm.version_span_metrics(samples)
    assert m["partial/resumed_share"] == 2 / 4
    assert m["partial/resumed_trajectory_share"] == 2 / 7
    assert m["partial/resumed_samples"] == 1.0  # aborted ones only (the older metric)
    assert fm.version_span_metrics([])["partial/resumed_share"] == 0.0


def test_generated_tokens_rate_between_reports():
    g = GeneratedTokens()
    assert g.rates({}) == {}
    first = g.rates({"rollouter/generated_tokens": 100.0, "rollouter/elapsed_s": 4.0})
    assert first == {"perf/generated_tokens_per_s_avg": 25.0, "perf/generated_tokens_per_s": 25.0}
    second = g.rates({"rollouter/generated_tokens": 400.0, "rollouter/elapsed_s": 6.0})
    assert second == {"perf/generated_tokens_per_s_avg": 400 / 6, "perf/generated_tokens_per_s": 150.0}


def test_peak_memory_reports_this_process_rss():
    import resource

    m = fm.peak_memory("trainer")
    assert m["trainer_rss_peak_gb"] * 2**30 >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 0.999
    assert ("trainer_device_peak_gb" in m) == (torch.cuda.is_available() and torch.cuda.is_initialized())


def test_process_tree_holds_children_and_grandchildren_only():
    import os
    import subprocess
    import sys

    from ferryman.cluster.processes import process_tree

    grandchild = "import time; time.sleep(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
         "print(p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        gpid = int(child.stdout.readline())
        tree = process_tree(child.pid)
        assert tree == {child.pid, gpid}
        mine = process_tree(os.getpid())
        assert {os.getpid(), child.pid, gpid, other.pid} <= mine  # a new session is still a child
        assert process_tree(other.pid) == {other.pid}
        assert 1 not in mine or os.getpid() == 1
        # NVML's pid -> bytes: only the tree's count
        used = {child.pid: 5 * 2**20, gpid: 7 * 2**20, other.pid: 100 * 2**20, 999_999_999: 1}
        assert fm.tree_device_bytes(child.pid, used) == 12 * 2**20
        assert fm.tree_device_bytes(child.pid, None) == 0 and fm.tree_device_bytes(child.pid, {}) == 0
    finally:
        for p in (child, other):
            p.kill()
            p.wait()
        try:
            os.kill(gpid, 9)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_nvml_figure_is_absent_without_nvml():
    import importlib.util

    if importlib.util.find_spec("pynvml") is None:
        assert fm.nvml_process_bytes() is None
        assert "trainer_device_used_gb" not in fm.peak_memory("trainer")
    else:  # a machine with nvidia-ml-py: a dict, or None without a driver
        got = fm.nvml_process_bytes()
        assert got is None or all(isinstance(p, int) and b > 0 for p, b in got.items())


def test_run_report_summary():
    r = fm.RunReport()
    r.update({"reward/mean": 0.1, "sync/generation_pause_s": 0.5, "memory/trainer_rss_peak_gb": 1.0, "trainer/idle_ratio": 0.4})
    r.update({"reward/mean": 0.7, "memory/trainer_rss_peak_gb": 1.5, "trainer/idle_ratio": 0.2, "partial/resumed_share": 0.25})
    r.update({"reward/mean": 0.5, "sync/generation_pause_s": 1.5, "memory/trainer_rss_peak_gb": 1.2, "mismatch/abs_diff_mean": float("nan")})
    s = r.summary()
    assert s["steps_reported"] == 3
    assert (s["reward_mean_first"], s["reward_mean_last"], s["reward_mean_max"]) == (0.1, 0.5, 0.7)
    assert s["generation_pause_s_per_sync"] == 1.0  # mean over the steps that synced
    assert s["trainer_idle_ratio"] == 0.2 and s["partial_rollout_share"] == 0.25
    assert s["trainer_rss_peak_gb"] == 1.5
    assert "mismatch_abs_diff_mean" not in s  # non-finite values are skipped
