"""What a run reports, read back from its ``metrics.jsonl`` (and ``summary.json``), with the GPU
run's goals checked: at least ``--min-syncs`` weight syncs, and the reward's 5-step moving
average reaching ``--reward-share`` of its maximum (1.0) within ``--within-s`` seconds of
training (and, reported beside it, of the run's start, engine start-up included).

    python3 bench/gpu_report.py RUN_DIR [--min-syncs 10 --reward-share 0.8 --within-s 300] [--plot reward.png]

A run continued by ``ferryman train --resume`` (``bench/gpu_e2e.sh`` with ``PART=1``, then
``PART=2``) is one run in several parts: ``metrics.jsonl`` holds every step once (the resumed
part drops the steps after its checkpoint and appends), and each part left its ``run.json``
as ``run.partN.json``. Times are then counted per part and added up: *training time* runs from
the start of each part's first step to its last step (start-up and the pause between the
commands left out), *run time* from each part's start (its start-up included). ``--plot``
draws the reward curve against run time, parts joined.

Prints one block of text; exit status 0 whatever the goals say (the text says it), 2 when the
run left no metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ferryman.defaults.trackers import read_metrics

KEYS = [
    ("generated tokens/s (per step, mean)", "perf/generated_tokens_per_s", "mean"),
    ("generation pause per sync, s (mean)", "sync/generation_pause_s", "mean"),
    ("generation pause per sync, s (max)", "sync/generation_pause_s", "max"),
    ("weight transfer per sync, s (mean)", "sync/transfer_s", "mean"),
    ("partial-rollout share (mean)", "partial/resumed_share", "mean"),
    ("mismatch/kl_k3_fresh (mean)", "mismatch/kl_k3_fresh", "mean"),
    ("token staleness (mean)", "staleness/token_mean", "mean"),
    ("response length (mean)", "response/length_mean", "mean"),
    ("actor/entropy (mean)", "actor/entropy", "mean"),
    ("trainer step, s (mean)", "timing/step_s", "mean"),
]
PART_KEYS = [
    # averages over a process's life: one value per part
    ("generated tokens/s (run avg)", "perf/generated_tokens_per_s_avg"),
    ("trained samples/s (run avg)", "perf/samples_per_s_avg"),
    ("trainer idle ratio", "trainer/idle_ratio"),
    ("Rollouter idle ratio", "rollouter/idle_ratio"),
]


def _agg(rows: list[dict], key: str, how: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not vals:
        return None
    return {"last": vals[-1], "mean": sum(vals) / len(vals), "max": max(vals)}[how]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def load_rows(run: Path) -> list[dict]:
    rows = read_metrics(run)  # a line torn by a kill is skipped
    # one row per step, the last written (a resumed run rewrites the steps after its checkpoint)
    by_step = {r["step"]: r for r in rows if "step" in r}
    return [by_step[s] for s in sorted(by_step)] if by_step else rows


def part_starts(run: Path, rows: list[dict]) -> list[float]:
    """Start times of the run's parts: every ``run.partN.json`` and the current ``run.json``."""
    starts = set()
    for p in sorted(run.glob("run.part*.json")) + [run / "run.json"]:
        try:
            starts.add(round(float(json.loads(p.read_text())["started_at"]), 3))
        except (OSError, ValueError, KeyError):
            continue
    if not starts:
        starts.add(rows[0]["time"] - rows[0].get("timing/step_s", 0.0))
    return sorted(starts)


def split_parts(rows: list[dict], starts: list[float]) -> list[dict]:
    """Rows grouped by the part whose start precedes them; empty parts dropped."""
    parts: list[dict] = []
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [r for r in rows if s <= r["time"] < end]
        if mine:
            first = mine[0]["time"] - mine[0].get("timing/step_s", 0.0)
            parts.append({"started_at": s, "rows": mine, "first": first, "startup": first - s, "train_s": mine[-1]["time"] - first, "run_s": mine[-1]["time"] - s})
    return parts


def timings(parts: list[dict]) -> list[tuple[dict, float, float]]:
    """``(row, training seconds, run seconds)`` for every row, parts added up."""
    out = []
    t_train = t_run = 0.0
    for p in parts:
        for r in p["rows"]:
            out.append((r, t_train + r["time"] - p["first"], t_run + r["time"] - p["started_at"]))
        t_train += p["train_s"]
        t_run += p["run_s"]
    return out


def plot(path: str, timed: list[tuple[dict, float, float]], parts: list[dict], goal: float, k: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [t / 60 for _, _, t in timed]
    reward = [r["reward/mean"] for r, _, _ in timed]
    smooth = [sum(reward[max(0, i - k + 1): i + 1]) / len(reward[max(0, i - k + 1): i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(minutes, reward, label="reward/mean (per step)", color="tab:blue", alpha=0.45)
    ax.plot(minutes, smooth, label=f"reward/mean ({k}-step moving average)", color="tab:blue")
    ent = [(m, r["actor/entropy"]) for m, (r, _, _) in zip(minutes, timed) if isinstance(r.get("actor/entropy"), (int, float))]
    ax.axhline(goal, color="grey", linestyle=":", label=f"{goal:g}")
    t_run = 0.0
    for i, p in enumerate(parts[:-1]):
        t_run += p["run_s"]
        ax.axvline(t_run / 60, color="black", lw=0.8, ls="--", label="resumed (next part)" if i == 0 else None)
    ax.set_xlabel("run time (minutes, start-up included" + (", parts joined)" if len(parts) > 1 else ")"))
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    h, lab = ax.get_legend_handles_labels()
    if ent:
        ax2 = ax.twinx()
        ax2.plot([m for m, _ in ent], [e for _, e in ent], color="tab:green", alpha=0.6, label="actor/entropy (nats/token)")
        ax2.set_ylabel("entropy per generated token (nats)")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        h, lab = h + h2, lab + l2
    ax.legend(h, lab, loc="center right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--min-syncs", type=int, default=10)
    ap.add_argument("--reward-share", type=float, default=0.8)
    ap.add_argument("--reward-max", type=float, default=1.0)
    ap.add_argument("--within-s", type=float, default=300.0)
    ap.add_argument("--window", type=int, default=5, help="moving-average steps")
    ap.add_argument("--plot", default=None, help="also draw the reward curve into this image file")
    ap.add_argument("--title", default=None, help="the chart's title")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    rows = load_rows(run)
    if not rows:
        print(f"{run}: no metrics (the run did not finish a step); see train.log")
        return 2
    parts = split_parts(rows, part_starts(run, rows))
    timed = timings(parts)
    syncs = sum(1 for r in rows if "sync/version" in r)
    reward = [r["reward/mean"] for r in rows]
    k = args.window
    smooth = [sum(reward[max(0, i - k + 1): i + 1]) / len(reward[max(0, i - k + 1): i + 1]) for i in range(len(reward))]
    goal = args.reward_share * args.reward_max
    hit = next((i for i, v in enumerate(smooth) if v >= goal), None)
    train_total = sum(p["train_s"] for p in parts)
    run_total = sum(p["run_s"] for p in parts)
    lines = [
        f"run {run}: {len(rows)} steps (steps {rows[0]['step']}..{rows[-1]['step']}), {syncs} weight syncs, "
        f"{train_total:.0f} s of training, {run_total:.0f} s of run time in {len(parts)} part(s)",
    ]
    for i, p in enumerate(parts, 1):
        lines.append(
            f"  part {i}: steps {p['rows'][0]['step']}..{p['rows'][-1]['step']}, {p['startup']:.0f} s start-up, "
            f"{p['train_s']:.0f} s of training ({p['train_s'] / len(p['rows']):.2f} s/step)"
        )
    lines.append(f"reward/mean: first {reward[0]:.3f}, last {reward[-1]:.3f}, max {max(reward):.3f}; {k}-step average last {smooth[-1]:.3f}, max {max(smooth):.3f}")
    for key in ("sequence/exact", "sequence/prefix"):
        if any(key in r for r in rows):
            lines.append(f"  {key}: last {k}-step mean {_fmt(_agg(rows[-k:], key, 'mean'))}")
    if hit is None:
        lines.append(f"reward {k}-step average never reached {goal:.2f}")
    else:
        _, t_train, t_run = timed[hit]
        lines.append(f"reward {k}-step average reached {goal:.2f} at step {rows[hit]['step']}: {t_train:.0f} s of training, {t_run:.0f} s of run time")
    for label, key in PART_KEYS:
        vals = [_agg(p["rows"], key, "last") for p in parts]
        lines.append(f"  {label}: " + " / ".join(_fmt(v) for v in vals) + (" (per part)" if len(parts) > 1 else ""))
    for label, key, how in KEYS:
        lines.append(f"  {label}: {_fmt(_agg(rows, key, how))}")
    mm = "mismatch/abs_diff_mean"
    first_mm = next(((r["step"], r[mm]) for r in rows if mm in r), None)
    late = [r for r in rows if mm in r and r["step"] > args.min_syncs]
    lines.append(
        f"  {mm}: "
        + (f"{first_mm[1]:.4g} at step {first_mm[0]} (version {first_mm[0] - 1})" if first_mm else "-")
        + (f"; steps {args.min_syncs + 1}+ (after >= {args.min_syncs} syncs): mean {_agg(late, mm, 'mean'):.4g}, max {_agg(late, mm, 'max'):.4g}" if late else "")
    )
    mem = sorted({key for r in rows for key in r if key.startswith("memory/")})
    for key in mem:
        lines.append(f"  peak {key.removeprefix('memory/')}: {_agg(rows, key, 'max'):.3f} GiB")
    ok_syncs = syncs >= args.min_syncs
    ok_reward = hit is not None and timed[hit][1] <= args.within_s
    lines.append(
        f"GOALS: syncs >= {args.min_syncs}: {'yes' if ok_syncs else 'NO'}; reward >= {goal:.2f} within "
        f"{args.within_s:.0f} s of training: {'yes' if ok_reward else 'NO'}"
    )
    summary = run / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        if s.get("error"):
            lines.append(f"run error: {s['error']}")
        if s.get("lost_replicas"):
            lines.append(f"lost replicas: {s['lost_replicas']}")
    print("\n".join(lines))
    if args.plot:
        plot(args.plot, timed, parts, goal, k, args.title or f"{run}: {len(rows)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
