"""What a run reports, read back from its ``metrics.jsonl`` (and ``summary.json``), with the GPU
run's goals checked: at least ``--min-syncs`` weight syncs, and the reward's 5-step moving
average reaching ``--reward-share`` of its maximum (1.0) within ``--within-s`` seconds of the
first trainer step (and, reported beside it, of the run's start, engine start-up included).

    python3 bench/gpu_report.py RUN_DIR [--min-syncs 10 --reward-share 0.8 --within-s 300]

Prints one block of text; exit status 0 whatever the goals say (the text says it), 2 when the
run left no metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = [
    ("generated tokens/s (run avg)", "perf/generated_tokens_per_s_avg", "last"),
    ("generated tokens/s (per step, mean)", "perf/generated_tokens_per_s", "mean"),
    ("trained samples/s (run avg)", "perf/samples_per_s_avg", "last"),
    ("trainer idle ratio", "trainer/idle_ratio", "last"),
    ("Rollouter idle ratio", "rollouter/idle_ratio", "last"),
    ("generation pause per sync, s (mean)", "sync/generation_pause_s", "mean"),
    ("generation pause per sync, s (max)", "sync/generation_pause_s", "max"),
    ("weight transfer per sync, s (mean)", "sync/transfer_s", "mean"),
    ("partial-rollout share (mean)", "partial/resumed_share", "mean"),
    ("mismatch/abs_diff_mean (mean)", "mismatch/abs_diff_mean", "mean"),
    ("mismatch/kl_k3_fresh (mean)", "mismatch/kl_k3_fresh", "mean"),
    ("token staleness (mean)", "staleness/token_mean", "mean"),
    ("response length (mean)", "response/length_mean", "mean"),
]


def _agg(rows: list[dict], key: str, how: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not vals:
        return None
    return {"last": vals[-1], "mean": sum(vals) / len(vals), "max": max(vals)}[how]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--min-syncs", type=int, default=10)
    ap.add_argument("--reward-share", type=float, default=0.8)
    ap.add_argument("--reward-max", type=float, default=1.0)
    ap.add_argument("--within-s", type=float, default=300.0)
    ap.add_argument("--window", type=int, default=5, help="moving-average steps")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    if not rows:
        print(f"{run}: no metrics (the run did not finish a step); see train.log")
        return 2
    started = json.loads((run / "run.json").read_text())["started_at"] if (run / "run.json").is_file() else rows[0]["time"]
    first = rows[0]["time"] - rows[0].get("timing/step_s", 0.0)
    syncs = sum(1 for r in rows if "sync/version" in r)
    reward = [r["reward/mean"] for r in rows]
    k = args.window
    smooth = [sum(reward[max(0, i - k + 1): i + 1]) / len(reward[max(0, i - k + 1): i + 1]) for i in range(len(reward))]
    goal = args.reward_share * args.reward_max
    hit = next((i for i, v in enumerate(smooth) if v >= goal), None)
    lines = [
        f"run {run}: {len(rows)} steps, {syncs} weight syncs, {rows[-1]['time'] - started:.0f} s from start "
        f"({first - started:.0f} s start-up before the first step)",
        f"reward/mean: first {reward[0]:.3f}, last {reward[-1]:.3f}, max {max(reward):.3f}; {k}-step average last {smooth[-1]:.3f}",
    ]
    if hit is None:
        lines.append(f"reward {k}-step average never reached {goal:.2f}")
    else:
        t_train, t_run = rows[hit]["time"] - first, rows[hit]["time"] - started
        lines.append(f"reward {k}-step average reached {goal:.2f} at step {hit + 1}: {t_train:.0f} s after the first step, {t_run:.0f} s after the start")
    for label, key, how in KEYS:
        v = _agg(rows, key, how)
        lines.append(f"  {label}: {'-' if v is None else f'{v:.4g}'}")
    mem = sorted({k for r in rows for k in r if k.startswith("memory/")})
    for key in mem:
        lines.append(f"  peak {key.removeprefix('memory/')}: {_agg(rows, key, 'max'):.3f} GiB")
    ok_syncs = syncs >= args.min_syncs
    ok_reward = hit is not None and rows[hit]["time"] - first <= args.within_s
    lines.append(
        f"GOALS: syncs >= {args.min_syncs}: {'yes' if ok_syncs else 'NO'}; reward >= {goal:.2f} within "
        f"{args.within_s:.0f} s of training: {'yes' if ok_reward else 'NO'}"
    )
    summary = run / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        if s.get("error"):
            lines.append(f"run error: {s['error']}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
