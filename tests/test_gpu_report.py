"""bench/gpu_report.py reads a run's metrics back and checks the GPU run's goals right."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _write_run(run: Path, rewards: list[float], t0: float = 1000.0, step_s: float = 20.0) -> None:
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"started_at": t0 - 60}))  # 60 s of start-up
    rows = []
    for i, r in enumerate(rewards):
        rows.append({"step": i + 1, "time": t0 + (i + 1) * step_s, "timing/step_s": step_s, "reward/mean": r,
                     "sync/version": float(i + 1), "sync/generation_pause_s": 0.5 + i, "memory/trainer_device_peak_gb": 3.0 + i})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_goals(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "bench" / "gpu_report.py"))["main"]
    # 5-step average first reaches 0.8 at step 12 (0.7, 0.8, 0.8, 0.9, 0.9 -> 0.82): 240 s after the first step
    rewards = [0.1] * 7 + [0.7, 0.8, 0.8, 0.9, 0.9, 0.9]
    _write_run(tmp_path / "a", rewards)
    assert main([str(tmp_path / "a"), "--min-syncs", "10", "--within-s", "300"]) == 0
    out = capsys.readouterr().out
    assert "13 steps, 13 weight syncs" in out
    assert "reached 0.80 at step 12: 240 s after the first step, 300 s after the start" in out
    assert "generation pause per sync, s (mean): 6.5" in out and "peak trainer_device_peak_gb: 15.000 GiB" in out
    assert "GOALS: syncs >= 10: yes; reward >= 0.80 within 300 s of training: yes" in out
    assert main([str(tmp_path / "a"), "--min-syncs", "20", "--within-s", "200"]) == 0
    assert "GOALS: syncs >= 20: NO; reward >= 0.80 within 200 s of training: NO" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
