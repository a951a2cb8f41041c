"""Fault injection on the main pipeline: what each fault costs, and how long recovery takes.

Every trial runs ``ferryman train`` in a subprocess on the tiny model (inline runtime: the real
transformers engines, FSDP2 trainer and digits env in one process), mode (d) (staleness 0.5,
partial rollout), 2 engine replicas, a checkpoint after every step, admission capped at exactly
the samples the steps consume. One uninterrupted run of the same seed is the reference.

Crashes (the process dies; ``ferryman train --resume`` continues):

* SIGKILL at a named point (``FERRYMAN_FAULTS``, random pass): during generation, during a
  weight transfer, right after the trainer took a sample (others waiting in the queue), while
  a checkpoint is being written;
* SIGKILL from outside at a random moment;
* SIGTERM (the run saves a checkpoint and exits 75), during generation.

Faults survived in the run (it completes): an engine replica dies; single agent runs raise; agent
runs hang past ``rollout.run_timeout_s``; a weight transfer fails (retried).

Per fault: trials, samples lost and trained twice (against the reference's set of sample ids),
steps redone (trained before the crash, after the last checkpoint), tokens of runs under way kept
across the crash, trajectories dropped, and recovery time: for a crash, from the death of the
process to the first training step of the resumed one (process start, model load, restore,
first step), with the restore alone in brackets; for a fault survived in the run, the extra time
of the step that absorbed it over the median step.

    .venv/bin/python bench/faults.py                       # 2 trials per fault (~20-40 min on 2 busy cores)
    .venv/bin/python bench/faults.py --trials 1 --only kill-gen,replica
    .venv/bin/python bench/faults.py --ray                 # + a replica and the trainer SIGKILLed on local Ray
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ferryman.defaults.trackers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS, W, N = 8, 2, 2

BASE = [
    "runtime=inline",
    "seed=5",
    f"rollout.n={N}",
    "rollout.max_tokens=8",
    "rollout.num_replicas=2",
    "rollout.max_concurrency_per_replica=1",
    f"rollout.total_rollout_steps={STEPS * W}",
    f"training.ppo_mini_batch_size={W}",
    f"training.total_steps={STEPS}",
    "training.weight_bucket_megabytes=0.04",
    "engine.step_delay_s=0.03",
    "env.num_tasks=6",
    "env.turns=2",
    "trainer.lr=1e-3",
    "trackers=[{type: jsonl}]",
    "async_training.staleness_threshold=0.5",
    "async_training.partial_rollout=true",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2",
]
CALLS = STEPS * W * N * 2  # generate calls of a whole run (2 turns per run)


@dataclass
class Proc:
    rc: int
    started: float
    ended: float
    stdout: str
    stderr: str


def ferryman(args: list[str], faults: str | None = None, kill_after: float | None = None, run_dir: Path | None = None) -> Proc:
    """``ferryman train`` in a subprocess; ``kill_after``: SIGKILL it that many seconds after
    its first training step was logged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("FERRYMAN_FAULTS", None)
    if faults:
        env["FERRYMAN_FAULTS"] = faults
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "ferryman.cli", "train", *args], env=env, stdout=out, stderr=err, cwd=ROOT)
        if kill_after is not None:
            assert run_dir is not None
            while p.poll() is None and not (run_dir / "metrics.jsonl").is_file():
                time.sleep(0.05)
            deadline = time.time() + kill_after
            while p.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=900)
        ended = time.time()
        out.seek(0)
        err.seek(0)
        return Proc(rc, t0, ended, out.read(), err.read())


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def trained(s: dict) -> list[str]:
    return [u for st in s.get("steps", []) for u in st["sample_uids"]]


@dataclass
class Result:
    name: str
    where: str
    trials: int = 0
    injections: int = 0
    lost: int = 0
    twice: int = 0
    wrong_steps: int = 0
    redone: list[int] = field(default_factory=list)
    kept_tokens: list[float] = field(default_factory=list)
    dropped: list[float] = field(default_factory=list)
    recovery: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)

    def check(self, s: dict, reference: set[str]) -> None:
        uids = trained(s)
        self.lost += len(reference - set(uids))
        self.twice += len(uids) - len(set(uids))
        if [st["step"] for st in s.get("steps", [])] != list(range(1, STEPS + 1)):
            self.wrong_steps += 1


def crash_trial(res: Result, base_args: list[str], reference: set[str], work: Path, *, faults: str | None = None,
                kill_after: float | None = None, expect_rc: int = -signal.SIGKILL) -> None:
    run_dir = work / f"{res.name}-{res.trials}"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [*base_args, f"run_dir={run_dir}"]
    first = ferryman(args, faults, kill_after, run_dir)
    res.trials += 1
    if first.rc != expect_rc:
        res.notes.add(f"a trial ended with rc {first.rc}, not {expect_rc} (the fault missed); not counted")
        res.trials -= 1
        return
    res.injections += 1
    logged = len(read_metrics(run_dir))
    second = ferryman(["--resume", str(run_dir)])
    if second.rc != 0:
        raise RuntimeError(f"{res.name}: resume failed (rc {second.rc}):\n{second.stderr[-3000:]}")
    s = summary(run_dir)
    res.check(s, reference)
    resumed = s.get("resumed") or {}
    step0 = resumed.get("step", 0)
    res.redone.append(max(0, logged - step0))
    res.kept_tokens.append(resumed.get("kept_tokens", 0.0))
    res.restore.append(resumed.get("restore_s", float("nan")))
    new_rows = [r for r in read_metrics(run_dir) if r["step"] == step0 + 1]
    if new_rows:
        res.recovery.append(new_rows[0]["time"] - first.ended)


def survived_trial(res: Result, base_args: list[str], reference: set[str], work: Path, faults: str, extra: list[str] = ()) -> dict:
    run_dir = work / f"{res.name}-{res.trials}"
    shutil.rmtree(run_dir, ignore_errors=True)
    p = ferryman([*base_args, *extra, f"run_dir={run_dir}"], faults)
    if p.rc != 0:
        raise RuntimeError(f"{res.name}: run failed (rc {p.rc}):\n{p.stderr[-3000:]}")
    res.trials += 1
    s = summary(run_dir)
    res.check(s, reference)
    step_s = [r["timing/step_s"] for r in read_metrics(run_dir)]
    res.recovery.append(max(step_s) - statistics.median(step_s))
    return s


def fmt(xs: list[float], unit: str = "s", digits: int = 1) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "–"
    sep = " " if unit else ""
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}{sep}{unit}"
    return f"{statistics.median(xs):.{digits}f}{sep}{unit} (max {max(xs):.{digits}f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated fault keys (see FAULTS below)")
    ap.add_argument("--ray", action="store_true", help="also kill a replica and the trainer on local Ray")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.md"))
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="ferryman-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    base_args = [*BASE, f"model.path={model}", "model.build_tiny=true"]
    t_start = time.time()

    print(f"reference run (work dir {work}) ...", flush=True)
    ref_dir = work / "reference"
    p = ferryman([*base_args, f"run_dir={ref_dir}"])
    if p.rc != 0:
        print(p.stderr[-3000:])
        return 1
    ref = summary(ref_dir)
    reference = set(trained(ref))
    ref_step = statistics.median(r["timing/step_s"] for r in read_metrics(ref_dir))
    print(f"  {len(reference)} samples, {len(ref['steps'])} steps, {ref['wall_s']:.1f}s, median step {ref_step:.2f}s", flush=True)

    faults_list = {
        "kill-gen": ("SIGKILL during generation", "`rollout.generate@N=kill`, N ~ U[20, 50] of 64 calls"),
        "kill-sync": ("SIGKILL during a weight transfer", "`sync.bucket@N=kill`, N ~ U[15, 60] (~10 buckets a sync)"),
        "kill-queue": ("SIGKILL while samples wait in the queue", "`trainer.get@N=kill`, N ~ U[3, 12] of 16 takes"),
        "kill-ckpt": ("SIGKILL while a checkpoint is written", "`checkpoint.write@N=kill`, N ~ U[2, 6]"),
        "kill-random": ("SIGKILL from outside at a random moment", "`kill -9` U[0, 6] s after the first step"),
        "term-gen": ("SIGTERM during generation", "`rollout.generate@N=term`, N ~ U[20, 50]"),
        "replica": ("an engine replica dies", "`engine.generate@N:replica-1=die`, N ~ U[5, 15]"),
        "env-raise": ("agent runs raise", "`env.run@N=raise` at 3 random runs of 32"),
        "env-hang": ("agent runs hang (timeout 5 s)", "`env.run@N=hang` at 2 random runs, `rollout.run_timeout_s=5`"),
        "sync-fail": ("a weight transfer fails", "`sync.bucket@N=raise` at 2 random buckets, 3 attempts"),
    }
    only = {k for k in args.only.split(",") if k}
    results: list[Result] = []
    for key, (name, where) in faults_list.items():
        if only and key not in only:
            continue
        res = Result(key, where)
        results.append(res)
        print(f"{name} ...", flush=True)
        for _ in range(args.trials):
            if key == "kill-gen":
                crash_trial(res, base_args, reference, work, faults=f"rollout.generate@{rng.randint(20, 50)}=kill")
            elif key == "kill-sync":
                crash_trial(res, base_args, reference, work, faults=f"sync.bucket@{rng.randint(15, 60)}=kill")
            elif key == "kill-queue":
                crash_trial(res, base_args, reference, work, faults=f"trainer.get@{rng.randint(3, 12)}=kill")
            elif key == "kill-ckpt":
                crash_trial(res, base_args, reference, work, faults=f"checkpoint.write@{rng.randint(2, 6)}=kill")
            elif key == "kill-random":
                crash_trial(res, base_args, reference, work, kill_after=rng.uniform(0, 6))
            elif key == "term-gen":
                crash_trial(res, base_args, reference, work, faults=f"rollout.generate@{rng.randint(20, 50)}=term", expect_rc=75)
            elif key == "replica":
                s = survived_trial(res, base_args, reference, work, f"engine.generate@{rng.randint(5, 15)}:replica-1=die")
                res.injections += 1
                r = s["rollouter"]
                res.dropped.append(r["rollouter/runs_dispatched"] - r["rollouter/runs_finished"])
                if s.get("lost_replicas") != ["replica-1"]:
                    res.notes.add(f"lost_replicas = {s.get('lost_replicas')}")
            elif key == "env-raise":
                picks = sorted(rng.sample(range(1, STEPS * W * N + 1), 3))
                s = survived_trial(res, base_args, reference, work, ",".join(f"env.run@{k}=raise" for k in picks))
                res.injections += 3
                res.dropped.append(s["rollouter"]["rollouter/failed_trajectories"])
            elif key == "env-hang":
                picks = sorted(rng.sample(range(1, STEPS * W * N + 1), 2))
                s = survived_trial(res, base_args, reference, work, ",".join(f"env.run@{k}=hang" for k in picks), ["rollout.run_timeout_s=5"])
                res.injections += 2
                res.dropped.append(s["rollouter"]["rollouter/timed_out_trajectories"])
            elif key == "sync-fail":
                picks = sorted(rng.sample(range(5, 70), 2))
                s = survived_trial(res, base_args, reference, work, ",".join(f"sync.bucket@{k}=raise" for k in picks))
                res.injections += 2
                retries = max(st.get("sync/transfer_retries", 0) for st in s["syncs"])
                bad = [st for st in s["syncs"] if st["sync/version"] != s["syncs"].index(st) + 1]
                res.dropped.append(0.0)
                res.notes.add(f"transfer retries counted: {int(retries)} per run" + ("; VERSION MISMATCH" if bad else ""))
            print(f"  trial {res.trials}: lost {res.lost}, twice {res.twice}, redone {res.redone[-1:]}, recovery {fmt(res.recovery[-1:])}", flush=True)

    ray_line = None
    if args.ray:
        print("local Ray: SIGKILL replica-1's actor, then the trainer's ...", flush=True)
        run_dir = work / "ray"
        shutil.rmtree(run_dir, ignore_errors=True)
        rargs = [*base_args, "runtime=ray", "ray_num_cpus=2", f"run_dir={run_dir}"]
        first = ferryman(rargs, "engine.generate@6:replica-1=kill,trainer.step@4=kill")
        logged = len(read_metrics(run_dir))
        second = ferryman(["--resume", str(run_dir)])
        s = summary(run_dir)
        uids = trained(s)
        new_rows = [r for r in read_metrics(run_dir) if r["step"] == s["resumed"]["step"] + 1] if s.get("resumed") else []
        ray_line = (
            f"| a replica's actor, then the trainer's SIGKILLed (local Ray) | `engine.generate@6:replica-1=kill,trainer.step@4=kill` | 1 × 2 "
            f"| {len(reference - set(uids))} | {len(uids) - len(set(uids))} | {max(0, logged - s['resumed']['step'])} "
            f"| {s['resumed'].get('kept_tokens', 0):.0f} | – "
            f"| {fmt([new_rows[0]['time'] - first.ended] if new_rows else [])} | {fmt([s['resumed']['restore_s']])} |"
        )
        print(f"  first rc {first.rc}, resume rc {second.rc}; {ray_line}", flush=True)

    load = os.getloadavg()
    lines = [
        "# Fault injection (bench/faults.py)",
        "",
        "```",
        "cd /work/wt/ckpt && .venv/bin/python bench/faults.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        f"Tiny model, inline runtime, mode (d), 2 engine replicas, {STEPS} steps × {W} samples × {N} runs × 2 turns, "
        f"a checkpoint after every step (keep 2), seed 5. Reference (uninterrupted) run: {ref['wall_s']:.1f} s, "
        f"median step {ref_step:.2f} s. Machine: 2 CPU cores shared with other jobs, load average at the end "
        f"{load[0]:.1f}; the whole bench took {(time.time() - t_start) / 60:.1f} min. Samples are compared by id "
        "(`e{epoch}-t{task}`) with the reference run's.",
        "",
        "| fault | injected at | trials × injections per trial | samples lost | samples trained twice | steps redone | tokens of runs under way kept | trajectories dropped | recovery time | of which restore |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        crash = res.name.startswith(("kill", "term"))
        lines.append(
            f"| {faults_list[res.name][0]} | {res.where} | {res.trials} × {res.injections // max(res.trials, 1)} | {res.lost} | {res.twice} "
            f"| {fmt([float(x) for x in res.redone], '', 0) if crash else '–'} | {fmt(res.kept_tokens, '', 0) if crash else '–'} "
            f"| {fmt(res.dropped, '', 0) if not crash else '–'} "
            f"| {fmt(res.recovery)}{'' if crash else ' extra on one step'} | {fmt(res.restore) if crash else '–'} |"
        )
    if ray_line:
        lines.append(ray_line)
    lines += [
        "",
        "Columns. *Samples lost / trained twice*: against the reference run's set of sample ids. *Steps redone*: "
        "steps logged after the last checkpoint, trained again after the resume (a step killed inside its weight "
        "sync was not logged yet and is not counted, though it is redone too). *Tokens of runs under way kept*: "
        "tokens that runs in flight at the checkpoint had generated, continued after the resume instead of "
        "regenerated. *Trajectories dropped*: agent runs that failed or timed out (counted by the Rollouter; "
        "their samples are trained with the other runs of the group). *Recovery time*: for a crash, from the "
        "death of the process to the end of the resumed process's first training step (a new Python process "
        "importing torch and transformers, loading the model, restoring, and one step); *of which restore*: "
        "loading the checkpoint, pushing the weights to the engines, refilling the queue and restarting the runs "
        "in flight. For a fault survived in the run: the longest step minus the median step.",
        "",
        "Step counts: " + ("every run ended with steps 1…%d, each once." % STEPS if all(r.wrong_steps == 0 for r in results) else "SOME RUNS HAD WRONG STEP COUNTS"),
        "",
    ]
    for res in results:
        for note in sorted(res.notes):
            lines.append(f"- {faults_list[res.name][0]}: {note}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
