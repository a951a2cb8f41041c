"""Plot a run's learning curve (reward per trainer step against wall time) from metrics.jsonl.

    uv run python bench/plot_curve.py runs/tiny_digits -o bench/results/tiny_digits_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit("no metrics")
    run_json = Path(args.run_dir) / "run.json"
    summary = Path(args.run_dir) / "summary.json"
    if run_json.exists():  # minutes since `ferryman train` started the run (start-up included)
        t0 = json.loads(run_json.read_text())["started_at"]
    elif summary.exists() and "started_at" in json.loads(summary.read_text()):
        t0 = json.loads(summary.read_text())["started_at"]
    else:
        t0 = rows[0]["time"] - rows[0].get("timing/step_s", 0.0)
    minutes = [(r["time"] - t0) / 60 for r in rows]
    reward = [r["reward/mean"] for r in rows]
    stale = [r.get("staleness/token_mean", 0.0) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(minutes, reward, label="reward/mean (per step)", color="tab:blue", alpha=0.5)
    k = 5
    smooth = [sum(reward[max(0, i - k + 1) : i + 1]) / len(reward[max(0, i - k + 1) : i + 1]) for i in range(len(reward))]
    ax.plot(minutes, smooth, label=f"reward/mean ({k}-step moving average)", color="tab:blue")
    ax.axhline(0.8, color="grey", linestyle=":", label="0.8")
    ax.set_xlabel("wall time since the run started (minutes, start-up included)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax2 = ax.twinx()
    ax2.plot(minutes, stale, color="tab:pink", alpha=0.6, label="staleness/token_mean")
    ax2.set_ylabel("token staleness (versions)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right")
    ax.set_title(args.title or f"{args.run_dir}: {len(rows)} steps")
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}; final 5-step mean reward {smooth[-1]:.3f}; first reaches >=0.8 at "
          + next((f"{m:.1f} min (step {i + 1})" for i, (m, v) in enumerate(zip(minutes, smooth)) if v >= 0.8), "never"))


if __name__ == "__main__":
    main()
