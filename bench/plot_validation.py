"""Plot a run's training reward and its validation curve (val/pass@1, val/pass@n, mean reward)
against the trainer step, from metrics.jsonl; print the validation table as markdown.

    uv run python bench/plot_validation.py runs/arithmetic -o bench/results/arithmetic_curve.png
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

    rows = [json.loads(x) for x in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/pass@1" in r]
    if not train or not val:
        raise SystemExit("metrics.jsonl needs training steps and validations")
    kpass = sorted({k for r in val for k in r if k.startswith("val/pass@") and k != "val/pass@1"})
    fig, ax = plt.subplots(figsize=(7.5, 4))
    window = 10
    steps = [r["step"] for r in train]
    rew = [r["reward/mean"] for r in train]
    smooth = [sum(rew[max(0, i - window + 1) : i + 1]) / len(rew[max(0, i - window + 1) : i + 1]) for i in range(len(rew))]
    ax.plot(steps, smooth, color="#B0B0B0", label=f"training reward ({window}-step mean, train phrasings)")
    vs = [r["step"] for r in val]
    ax.plot(vs, [r["val/pass@1"] for r in val], "o-", color="#4C78A8", label="validation pass@1 (held-out phrasing)")
    for k in kpass:
        ax.plot(vs, [r[k] for r in val], "s--", color="#9467BD", label=f"validation {k[4:]}")
    ax.set_xlabel("trainer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(args.title or Path(args.run_dir).name, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"| step | weights | pass@1 | {' | '.join(k[4:] for k in kpass)} | mean reward | response length | time |")
    print("|---|---|---|" + "---|" * len(kpass) + "---|---|---|")
    for r in val:
        extra = " | ".join(f"{r[k]:.3f}" for k in kpass)
        print(f"| {r['step']} | v{int(r['val/weight_version'])} | {r['val/pass@1']:.3f} | {extra} | {r['val/reward_mean']:.3f} | "
              f"{r['val/response_length_mean']:.1f} | {r['val/time_s']:.1f} s |")


if __name__ == "__main__":
    main()
