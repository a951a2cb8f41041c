"""From a run's trace to the seed's chart and its numbers.

:func:`build` turns trace records (:func:`ferryman.trace.read_trace`) into a :class:`Timeline`:
the Rollouter lane (one bar per trajectory, the part after its first abort marked as
resumed), the queue lane (one cell per sample from put to get, classed by staleness when the
Trainer took it), the Trainer lane (one block per local step), the weight syncs, and the waits
the seed draws as red boxes:

* ``wait first batch`` — the Trainer waits for samples at the start of a sync window;
* ``wait last batch train`` — the Rollouter has used its window's quota, runs nothing, and
  waits for the Trainer to finish the window (its admission is blocked by the quota and no
  trajectory is in flight);
* ``wait active task finish`` — a sync without partial rollout waits for the samples in
  flight to finish.

:func:`stats` computes, over a time range, throughput, the idle ratios of the Trainer and the
Rollouter as time integrals, the staleness histograms per sample and per token, the
partial-rollout ratio and span, wait totals, sync time and the time-weighted queue length.
:func:`draw` renders one or more timelines side by side with matplotlib (extra ``plot``).

Definitions (also in the package README):

* A weight sync's line spans the weight update itself: from the end of its wait for the
  Rollouter (``wait active task finish`` when that waits) to its end.
* Trainer busy = union of ``trainer.train`` spans (batch building through the actor update)
  and weight updates (sync lines); the rest of the range is Trainer idle time: waiting for
  samples, and waiting for the Rollouter before a sync.
* Rollouter busy = union of ``rollouter.traj`` spans (some trajectory is in flight).
* Staleness of a sample = Trainer version when it was taken − the sample's oldest token
  version; of a token = Trainer version − the token's version.
* A sample is *fresh* when every token came from the Trainer's current version, *resumed*
  (half and half in the chart) when its tokens span several versions and it is not fresh,
  and *stale* otherwise.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferryman.trace import read_trace

WAIT_FIRST = "wait first batch"
WAIT_LAST = "wait last batch train"
WAIT_ACTIVE = "wait active task finish"


@dataclass
class Traj:
    request_id: str
    uid: str
    start: float
    end: float
    ok: bool
    aborts: list[float] = field(default_factory=list)

    @property
    def resumed_from(self) -> float | None:
        return min(self.aborts) if self.aborts else None


@dataclass
class Cell:
    uid: str
    put: float
    get: float | None
    kind: str = "fresh"
    """``fresh``, ``stale``, ``resumed`` or ``untaken``."""


@dataclass
class Block:
    start: float
    end: float
    label: str = ""


@dataclass
class Wait:
    kind: str
    lane: str
    """``rollouter`` or ``trainer``."""
    start: float
    end: float


@dataclass
class Timeline:
    t0: float
    mode: str = "?"
    trajs: list[Traj] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    train: list[Block] = field(default_factory=list)
    steps: list[Block] = field(default_factory=list)
    syncs: list[Block] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    takes: list[dict[str, Any]] = field(default_factory=list)
    train_args: list[dict[str, Any]] = field(default_factory=list)
    sync_steps: list[dict[str, Any]] = field(default_factory=list)
    queue_len: list[tuple[float, int]] = field(default_factory=list)
    validations: list[Block] = field(default_factory=list)
    """``validation.run`` spans (label: the step), drawn in their own lane."""
    end: float = 0.0

    def step_range(self, first: int, last: int | None = None) -> tuple[float, float]:
        """Time range from the start of local step ``first`` (1-based) to the end of ``last``."""
        if not self.steps:
            raise ValueError("the trace has no trainer steps")
        last = len(self.steps) if last is None else min(last, len(self.steps))
        first = max(1, min(first, last))
        return self.steps[first - 1].start, self.steps[last - 1].end


# ----------------------------------------------------------------------------- interval maths


def merge(intervals: list[tuple[float, float]], lo: float | None = None, hi: float | None = None) -> list[tuple[float, float]]:
    """Union of intervals, clipped to ``[lo, hi]``, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if lo is not None:
            a = max(a, lo)
        if hi is not None:
            b = min(b, hi)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` inside ``[lo, hi]``."""
    return sum(b - a for a, b in merge(intervals, lo, hi))


def gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi]`` not covered by ``intervals``."""
    out = []
    cur = lo
    for a, b in merge(intervals, lo, hi):
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out


# ----------------------------------------------------------------------------- building


def sample_kind(version: int, min_version: int, max_version: int) -> str:
    if min_version < 0 or min_version >= version:
        return "fresh"
    if max_version > min_version:
        return "resumed"
    return "stale"


def build(records: list[dict[str, Any]]) -> Timeline:
    """A :class:`Timeline` from trace records (any order)."""
    recs = sorted((r for r in records if r.get("ph") in ("X", "i")), key=lambda r: r["ts"])
    if not recs:
        raise ValueError("the trace holds no events")
    starts = [r for r in recs if r["name"] == "run.start"]
    t0 = starts[0]["ts"] if starts else recs[0]["ts"]
    tl = Timeline(t0=t0, mode=str(starts[0]["args"].get("mode", "?")) if starts else "?")
    aborts: dict[str, list[float]] = {}
    puts: dict[str, float] = {}
    gets: dict[str, float] = {}
    blocked: list[tuple[float, float]] = []
    for r in recs:
        name, a, ts = r["name"], r["args"], r["ts"]
        end = ts + r.get("dur", 0.0)
        tl.end = max(tl.end, end)
        if name == "rollouter.traj":
            tl.trajs.append(Traj(a["request_id"], a["uid"], ts, end, bool(a["ok"])))
        elif name == "client.abort":
            aborts.setdefault(a["request_id"], []).append(ts)
        elif name == "queue.put":
            puts[a["uid"]] = ts
            tl.queue_len.append((ts, int(a["qsize"])))
        elif name == "queue.get":
            gets[a["uid"]] = ts
            tl.queue_len.append((ts, int(a["qsize"])))
        elif name == "trainer.take":
            tl.takes.append({**a, "ts": ts})
        elif name == "trainer.train":
            tl.train.append(Block(ts, end, str(a["step"])))
            tl.train_args.append(a)
        elif name == "trainer.step":
            tl.steps.append(Block(ts, end, str(a["step"])))
        elif name == "trainer.wait" and a.get("first_of_window"):
            tl.waits.append(Wait(WAIT_FIRST, "trainer", ts, end))
        elif name == "sync.update":
            tl.syncs.append(Block(ts, end, str(a["version"])))
        elif name == "sync.step":
            tl.sync_steps.append({**a, "ts": ts, "dur": r["dur"]})
            if a["step"] == "wait_rollouter" and a.get("wait_for_active"):
                tl.waits.append(Wait(WAIT_ACTIVE, "trainer", ts, end))
        elif name == "validation.run":
            tl.validations.append(Block(ts, end, str(a["step"])))
        elif name == "rollouter.blocked" and a["reason"] == "quota":
            blocked.append((ts, end))
    # a sync's line starts when the weights start moving: after it waited for the Rollouter
    waited = {int(st["version"]): st["dur"] for st in tl.sync_steps if st["step"] == "wait_rollouter"}
    for b in tl.syncs:
        b.start = min(b.end, b.start + waited.get(int(b.label), 0.0))
    for t in tl.trajs:
        t.aborts = sorted(x for x in aborts.get(t.request_id, []) if t.start <= x <= t.end)
    kinds = {t["uid"]: sample_kind(int(t["version"]), int(t["min_version"]), int(t["max_version"])) for t in tl.takes}
    # a cell ends when the Trainer took the sample for a step (colocated: later than its queue get)
    taken = {t["uid"]: t["ts"] for t in tl.takes}
    tl.cells = [
        Cell(uid, put, taken.get(uid, gets.get(uid)), kinds.get(uid, "untaken")) for uid, put in sorted(puts.items(), key=lambda kv: kv[1])
    ]
    # the Rollouter waits for the last batch's training: admission blocked by the quota while
    # no trajectory is in flight (the weight sync itself is drawn apart)
    busy = [(t.start, t.end) for t in tl.trajs] + [(b.start, b.end) for b in tl.syncs]
    for lo, hi in blocked:
        for a, b in gaps(busy, lo, hi):
            tl.waits.append(Wait(WAIT_LAST, "rollouter", a, b))
    tl.waits.sort(key=lambda w: w.start)
    return tl


def load(run_dir: str | Path) -> Timeline:
    return build(read_trace(run_dir))


# ----------------------------------------------------------------------------- numbers


def stats(tl: Timeline, start: float | None = None, end: float | None = None, *, skip_steps: int = 1) -> dict[str, Any]:
    """Numbers over ``[start, end]`` (absolute ``time.time()`` values). Default range: from the
    end of local step ``skip_steps`` (warm-up excluded) to the end of the last step.

    ``steps``, ``samples`` and ``syncs`` count what falls in the range (the rates' basis);
    ``trace_steps``, ``trace_samples`` and ``trace_syncs`` count the whole trace, and
    ``warmup_steps`` says how many first steps the default range left out."""
    skipped = 0
    if start is None or end is None:
        if not tl.steps:
            raise ValueError("the trace has no trainer steps")
        k = min(skip_steps, len(tl.steps) - 1)
        skipped = max(k, 0) if start is None else 0
        lo = tl.steps[k - 1].end if k > 0 else tl.t0
        hi = tl.steps[-1].end
        start = lo if start is None else start
        end = hi if end is None else end
    span = max(end - start, 1e-9)
    train = [(b.start, b.end) for b in tl.train + tl.syncs]
    trajs = [(t.start, t.end) for t in tl.trajs]
    in_range = [i for i, b in enumerate(tl.train) if start < b.end <= end]
    trained = [tl.train_args[i] for i in in_range]
    samples = sum(int(a["samples"]) for a in trained)
    tokens = sum(int(a["tokens"]) for a in trained)
    takes = [t for t in tl.takes if start <= t["ts"] <= end]
    hist_sample: Counter[int] = Counter()
    hist_token: Counter[int] = Counter()
    for t in takes:
        if int(t["min_version"]) >= 0:
            hist_sample[int(t["version"]) - int(t["min_version"])] += 1
        for v, c in t["token_versions"].items():
            hist_token[int(t["version"]) - int(v)] += int(c)
    spans = [int(t["max_version"]) - int(t["min_version"]) for t in takes if int(t["min_version"]) >= 0]
    waits: dict[str, float] = {WAIT_FIRST: 0.0, WAIT_LAST: 0.0, WAIT_ACTIVE: 0.0}
    for w in tl.waits:
        waits[w.kind] += max(0.0, min(w.end, end) - max(w.start, start))
    syncs = [b for b in tl.syncs if start <= b.start and b.end <= end]
    sync_steps: dict[str, list[float]] = {}
    for s in tl.sync_steps:
        if start <= s["ts"] and s["ts"] + s["dur"] <= end:
            sync_steps.setdefault(s["step"], []).append(s["dur"])
    qarea = 0.0
    series = tl.queue_len + [(max(end, tl.queue_len[-1][0]) if tl.queue_len else end, 0)]
    for (ta, qa), (tb, _) in zip(series, series[1:]):
        qarea += qa * max(0.0, min(tb, end) - max(ta, start))
    n_take = max(len(takes), 1)
    return {
        "range_s": span,
        "steps": len(in_range),
        "samples": samples,
        "samples_per_s": samples / span,
        "tokens_per_s": tokens / span,
        "trainer_idle_ratio": 1.0 - covered(train, start, end) / span,
        "rollouter_idle_ratio": 1.0 - covered(trajs, start, end) / span,
        "staleness_sample_hist": dict(sorted(hist_sample.items())),
        "staleness_token_hist": dict(sorted(hist_token.items())),
        "stale_sample_ratio": sum(c for k, c in hist_sample.items() if k > 0) / n_take,
        "partial_ratio": sum(1 for t in takes if int(t["aborts"]) > 0) / n_take,
        "version_span_mean": statistics.fmean(spans) if spans else 0.0,
        "version_span_max": max(spans, default=0),
        "waits_s": waits,
        "syncs": len(syncs),
        "sync_mean_s": statistics.fmean(b.end - b.start for b in syncs) if syncs else 0.0,
        "sync_steps_mean_s": {k: statistics.fmean(v) for k, v in sorted(sync_steps.items())},
        "queue_len_mean": qarea / span,
        "warmup_steps": skipped,
        "trace_steps": len(tl.steps),
        "trace_samples": sum(int(a["samples"]) for a in tl.train_args),
        "trace_syncs": len(tl.syncs),
    }


# ----------------------------------------------------------------------------- drawing

COLORS = {
    "traj": "#4C78A8",
    "resumed": "#F58518",
    "failed": "#C8C8C8",
    "fresh": "#B0B0B0",
    "stale": "#F4A6C6",
    "untaken": "#FFFFFF",
    "train": "#54A24B",
    "sync": "#F2CF1D",
    "wait": "#E45756",
    "validation": "#9467BD",
}
MODE_TITLES = {
    "a": "(a) on-policy",
    "b": "(b) streaming, fewer syncs",
    "c": "(c) async, stale samples",
    "d": "(d) async + partial rollout",
    "colocated": "colocated",
}


def _rows(intervals: list[tuple[float, float]], gap: float) -> list[int]:
    """Greedy row assignment so that intervals in one row do not overlap."""
    ends: list[float] = []
    rows = []
    for a, b in intervals:
        for i, e in enumerate(ends):
            if e + gap <= a:
                ends[i] = b
                rows.append(i)
                break
        else:
            ends.append(b)
            rows.append(len(ends) - 1)
    return rows


def draw_panel(subfig: Any, tl: Timeline, start: float, end: float, title: str, min_wait_s: float | None = None) -> None:
    """Draw one run's chart (three lanes sharing the time axis) into a matplotlib subfigure."""
    from matplotlib.patches import Rectangle

    t0 = start
    width = max(end - start, 1e-9)
    min_w = width * 0.004
    if min_wait_s is None:
        med = statistics.median([b.end - b.start for b in tl.train]) if tl.train else 0.0
        min_wait_s = max(0.2 * med, width * 0.005)
    vals = [b for b in tl.validations if b.end >= start and b.start <= end]
    ratios = [3.2, 1.4, 1.0] + ([0.6] if vals else [])
    axes = subfig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios, "hspace": 0.08})
    ax_r, ax_q, ax_t = axes[:3]
    if vals:  # validation lane: one block per validation (step label), never queued or trained on
        ax_v = axes[3]
        for b in vals:
            ax_v.add_patch(Rectangle((b.start - t0, 0.15), max(b.end - b.start, min_w), 0.7, facecolor=COLORS["validation"], lw=0))
            ax_v.text(b.start - t0, 0.5, f" val@{b.label}", fontsize=6, va="center", ha="left", clip_on=True)
        ax_v.set_ylim(0, 1)
        ax_v.set_yticks([])
        ax_v.set_ylabel("Validation", fontsize=8)
    subfig.suptitle(title, fontsize=10, x=0.02, ha="left")

    # Rollouter lane: one bar per trajectory
    trajs = sorted((t for t in tl.trajs if t.end >= start and t.start <= end), key=lambda t: t.start)
    rows = _rows([(t.start, t.end) for t in trajs], gap=min_w * 0.5)
    nrows = max(rows, default=0) + 1
    for t, row in zip(trajs, rows):
        y = row + 0.15
        cut = t.resumed_from
        solid_end = cut if cut is not None else t.end
        color = COLORS["traj"] if t.ok else COLORS["failed"]
        ax_r.add_patch(Rectangle((t.start - t0, y), max(solid_end - t.start, min_w), 0.7, color=color, lw=0))
        if cut is not None:
            ax_r.add_patch(
                Rectangle((cut - t0, y), max(t.end - cut, min_w), 0.7, facecolor="none", edgecolor=COLORS["resumed"], lw=1.1, ls="--")
            )
    ax_r.set_ylim(0, nrows)
    ax_r.set_yticks([])
    ax_r.set_ylabel("Rollouter", fontsize=8)

    # queue lane: a cell per sample from put to get, coloured by staleness at get
    cells = sorted((c for c in tl.cells if (c.get or tl.end) >= start and c.put <= end), key=lambda c: c.put)
    crow = _rows([(c.put, max(c.get or tl.end, c.put + min_w)) for c in cells], gap=min_w * 0.2)
    nq = max(crow, default=0) + 1
    for c, row in zip(cells, crow):
        x = c.put - t0
        w = max((c.get or tl.end) - c.put, min_w)
        y = row + 0.1
        if c.kind == "resumed":
            ax_q.add_patch(Rectangle((x, y + 0.4), w, 0.4, color=COLORS["fresh"], lw=0))
            ax_q.add_patch(Rectangle((x, y), w, 0.4, color=COLORS["stale"], lw=0))
        else:
            ax_q.add_patch(Rectangle((x, y), w, 0.8, facecolor=COLORS[c.kind], edgecolor="#888888", lw=0.3))
    ax_q.set_ylim(0, nq)
    ax_q.set_yticks([])
    ax_q.set_ylabel("Queue", fontsize=8)

    # Trainer lane: a block per local step
    for b in tl.train:
        if b.end >= start and b.start <= end:
            ax_t.add_patch(Rectangle((b.start - t0, 0.15), max(b.end - b.start, min_w), 0.7, facecolor=COLORS["train"], edgecolor="white", lw=0.5))
    ax_t.set_ylim(0, 1)
    ax_t.set_yticks([])
    ax_t.set_ylabel("Trainer", fontsize=8)

    # red boxes: the waits
    labelled: set[tuple[str, str]] = set()
    last_label: dict[str, float] = {}
    for w in tl.waits:
        if w.end - w.start < min_wait_s or w.end < start or w.start > end:
            continue
        ax = ax_r if w.lane == "rollouter" else ax_t
        top = nrows if w.lane == "rollouter" else 1
        ax.add_patch(
            Rectangle(
                (w.start - t0, 0.02 * top), w.end - w.start, 0.96 * top, facecolor=COLORS["wait"], alpha=0.22, edgecolor=COLORS["wait"], lw=1.0, zorder=3
            )
        )
        crowded = w.start - last_label.get(w.lane, -1e18) < 0.18 * width
        if not crowded and ((w.kind, w.lane) not in labelled or w.end - w.start >= 0.12 * width):
            labelled.add((w.kind, w.lane))
            last_label[w.lane] = w.start
            ax.text(w.start - t0, 0.98 * top, w.kind, fontsize=6.5, color=COLORS["wait"], va="top", ha="left", clip_on=True)

    # yellow lines: weight syncs
    for s in tl.syncs:
        if s.end >= start and s.start <= end:
            for ax in axes:
                ax.axvspan(s.start - t0, max(s.end, s.start + min_w) - t0, color=COLORS["sync"], alpha=0.9, lw=0, zorder=1.5)
    axes[-1].set_xlim(0, width)
    axes[-1].set_xlabel("seconds", fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)


def legend_handles() -> list[Any]:
    from matplotlib.patches import Patch

    return [
        Patch(color=COLORS["traj"], label="trajectory in flight"),
        Patch(color=COLORS["failed"], label="failed, or cut at the run's end"),
        Patch(facecolor="none", edgecolor=COLORS["resumed"], ls="--", label="resumed after abort"),
        Patch(facecolor=COLORS["fresh"], edgecolor="#888888", label="queued sample, fresh when taken"),
        Patch(color=COLORS["stale"], label="stale when taken (half: resumed)"),
        Patch(color=COLORS["train"], label="trainer step (mini-batch)"),
        Patch(color=COLORS["sync"], label="weight sync"),
        Patch(color=COLORS["validation"], label="validation (held-out tasks)"),
        Patch(facecolor=COLORS["wait"], alpha=0.3, edgecolor=COLORS["wait"], label="wait"),
    ]


def draw(
    panels: list[tuple[Timeline, float, float, str]],
    path: str | Path,
    *,
    ncols: int | None = None,
    panel_size: tuple[float, float] = (7.5, 4.2),
    min_wait_s: float | None = None,
) -> Path:
    """Render ``(timeline, start, end, title)`` panels side by side (a grid of ``ncols``) into a
    PNG (or any format matplotlib infers from the suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("drawing a timeline needs matplotlib: pip install 'ferryman[plot]'") from e
    n = len(panels)
    if n == 0:
        raise ValueError("draw: no panels")
    ncols = ncols or min(n, 2)
    nrows = (n + ncols - 1) // ncols
    fig = plt.figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows + 0.6), layout="constrained")
    subfigs = fig.subfigures(nrows, ncols, squeeze=False)
    for i, (tl, lo, hi, title) in enumerate(panels):
        draw_panel(subfigs[i // ncols][i % ncols], tl, lo, hi, title, min_wait_s)
    for j in range(n, nrows * ncols):
        subfigs[j // ncols][j % ncols].set_visible(False)
    fig.legend(handles=legend_handles(), loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def panel_title(tl: Timeline, s: dict[str, Any], label: str | None = None) -> str:
    name = label or MODE_TITLES.get(tl.mode, f"mode {tl.mode}")
    idle_t, idle_r = 100 * s["trainer_idle_ratio"], 100 * s["rollouter_idle_ratio"]
    return f"{name}: {s['samples_per_s']:.2f} samples/s, trainer idle {idle_t:.0f}%, rollouter idle {idle_r:.0f}%"
