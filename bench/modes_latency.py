"""Per-mode trainer step time, sample latency and samples in the system, from the traces that
``bench/modes.py`` recorded (the numbers behind the arithmetic in bench/results/modes.md).

    .venv/bin/python bench/modes_latency.py /tmp/m2/full colocated,a,b,c,d,d@1,d@2

Over the same range as modes.py (end of the first window to the end of the last step):
``train/step`` = mean ``trainer.train`` span; latency = ``rollouter.sample`` span (admission to
queue) of the samples queued in the range; in system = throughput × mean latency (Little's law).
"""

from __future__ import annotations

import argparse
import statistics

from ferryman import timeline
from ferryman.trace import read_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="modes.py --out directory")
    p.add_argument("modes", help="comma-separated, as modes.py --modes")
    p.add_argument("--skip-steps", type=int, default=4, help="window // mini of the run (warm-up steps)")
    args = p.parse_args()
    print("| mode | samples/s | train time per step | mean sample latency | p90 | samples in system | staleness (versions: samples) |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        recs = read_trace(f"{args.out}/run-{mode}", strict=True)
        tl = timeline.build(recs)
        s = timeline.stats(tl, skip_steps=args.skip_steps)
        lo, hi = tl.steps[args.skip_steps - 1].end, tl.steps[-1].end
        lat = sorted(
            r["dur"] for r in recs if r["name"] == "rollouter.sample" and r["args"].get("queued") and lo <= r["ts"] + r["dur"] <= hi
        )
        train = [b.end - b.start for b in tl.train if lo < b.end <= hi]
        mean_lat = statistics.fmean(lat) if lat else float("nan")
        p90 = lat[int(0.9 * len(lat))] if lat else float("nan")
        hist = ", ".join(f"{k}: {v}" for k, v in s["staleness_sample_hist"].items())
        print(
            f"| {mode} | {s['samples_per_s']:.3f} | {statistics.fmean(train):.2f} s | {mean_lat:.1f} s | {p90:.1f} s | "
            f"{s['samples_per_s'] * mean_lat:.1f} | {hist} |"
        )


if __name__ == "__main__":
    main()
