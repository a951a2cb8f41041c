"""bench/gpu_report.py reads a run's metrics back and checks the GPU run's goals right."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(rewards: list[float], t0: float, step_s: float, first_step: int = 1) -> list[dict]:
    rows = []
    for i, r in enumerate(rewards):
        s = first_step + i
        rows.append({"step": s, "time": t0 + (i + 1) * step_s, "timing/step_s": step_s, "reward/mean": r,
                     "sync/version": float(s), "sync/generation_pause_s": 0.5 + i, "memory/trainer_device_peak_gb": 3.0 + i,
                     "mismatch/abs_diff_mean": 0.01 if s == 1 else 0.001 * s, "trainer/idle_ratio": 0.1 * first_step})
    return rows


def _write_run(run: Path, rewards: list[float], t0: float = 1000.0, step_s: float = 20.0) -> None:
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"started_at": t0 - 60}))  # 60 s of start-up
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(rewards, t0, step_s)))


def test_goals(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "bench" / "gpu_report.py"))["main"]
    # 5-step average first reaches 0.8 at step 12 (0.7, 0.8, 0.8, 0.9, 0.9 -> 0.82): 240 s after the first step
    rewards = [0.1] * 7 + [0.7, 0.8, 0.8, 0.9, 0.9, 0.9]
    _write_run(tmp_path / "a", rewards)
    assert main([str(tmp_path / "a"), "--min-syncs", "10", "--within-s", "300"]) == 0
    out = capsys.readouterr().out
    assert "13 steps (steps 1..13), 13 weight syncs, 260 s of training, 320 s of run time in 1 part(s)" in out
    assert "reached 0.80 at step 12: 240 s of training, 300 s of run time" in out
    assert "generation pause per sync, s (mean): 6.5" in out and "peak trainer_device_peak_gb: 15.000 GiB" in out
    # version 0 is step 1; after 10 syncs: steps 11..13 (0.011, 0.012, 0.013)
    assert "mismatch/abs_diff_mean: 0.01 at step 1 (version 0); steps 11+ (after >= 10 syncs): mean 0.012, max 0.013" in out
    assert "GOALS: syncs >= 10: yes; reward >= 0.80 within 300 s of training: yes" in out
    assert main([str(tmp_path / "a"), "--min-syncs", "20", "--within-s", "200"]) == 0
    assert "GOALS: syncs >= 20: NO; reward >= 0.80 within 200 s of training: NO" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2


def test_two_parts(tmp_path, capsys):
    """A run stopped at step 6 (checkpoint) and resumed in a later command: the pause between the
    commands and the second start-up do not count as training; each step is counted once."""
    main = runpy.run_path(str(ROOT / "bench" / "gpu_report.py"))["main"]
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.part1.json").write_text(json.dumps({"started_at": 940.0}))  # part 1: 60 s start-up, steps 1..6 at 10 s
    (run / "run.json").write_text(json.dumps({"started_at": 5000.0}))  # part 2: an hour later, 100 s start-up
    part1 = _rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1000.0, 10.0)
    part2 = _rows([0.8, 0.9, 0.9, 0.9], 5100.0, 10.0, first_step=7)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part1 + part2))
    assert main([str(run), "--min-syncs", "5", "--within-s", "100", "--plot", str(tmp_path / "reward.png")]) == 0
    out = capsys.readouterr().out
    assert "10 steps (steps 1..10), 10 weight syncs, 100 s of training, 260 s of run time in 2 part(s)" in out
    assert "part 1: steps 1..6, 60 s start-up, 60 s of training" in out
    assert "part 2: steps 7..10, 100 s start-up, 40 s of training" in out
    # 5-step averages: step 8 = (0.4+0.5+0.6+0.8+0.9)/5 = 0.64, step 9 = 0.74, step 10 = (0.6+0.8+0.9*3)/5 = 0.82:
    # 60 s (part 1) + 40 s into part 2 = 100 s of training; run time 120 + 140 = 260 s
    assert "reached 0.80 at step 10: 100 s of training, 260 s of run time" in out
    assert "trainer idle ratio: 0.1 / 0.7 (per part)" in out
    assert "GOALS: syncs >= 5: yes; reward >= 0.80 within 100 s of training: yes" in out
    assert (tmp_path / "reward.png").stat().st_size > 1000
