"""Faults on the GPU (issue "GPU runs on one H200", run 7): an engine replica's actor process is
SIGKILLed in the middle of a run-1-like training; the run must quarantine the replica and go on;
then the run is stopped (SIGTERM: a checkpoint at the next sync, exit 75, the log names the
checkpoint) and ``ferryman train --resume`` finishes it, with no sample lost and none trained twice.

    python3 bench/gpu_faults.py --out OUT [--config examples/gpu/one_gpu.yaml] [--steps 40]
                                [--kill-at 10] [--after-kill 10] [--total-s 540] [overrides ...]

(``bench/gpu_faults.sh`` runs it on the project's GPU machine; with ``--config`` a CPU config it
checks the same logic with transformers engines.)

1. ``ferryman train CONFIG`` for ``--steps`` steps, admission capped at exactly the samples those
   steps take (``rollout.total_rollout_steps = steps x ppo_mini_batch_size``), in a process
   session of its own. Ray's workers stay in that session; the engine replicas are the workers
   whose process title is ``ray::EngineActor`` (Ray names an actor's process after its class).
2. Once ``--kill-at`` steps are logged, SIGKILL one of them (the one with the highest pid).
3. The run must go on: ``--after-kill`` more steps logged, with ``sync/lost_replicas`` = 1 in
   the metrics (the Synchronizer dropped the replica and the router quarantined it). If the
   run stops by itself instead, its exit must name a checkpoint to resume from.
4. SIGTERM to the driver: exit 75 and ``checkpoint <path>`` on its last line; the summary
   names the lost replica (``lost_replicas``).
5. ``ferryman train --resume RUN_DIR``: exit 0, both replicas back.
6. Checks on the finished run: its summary holds steps 1..N each once; no sample id twice; the
   trained samples are exactly the ones the seeded admission order gives for ``N x
   ppo_mini_batch_size`` samples (the Rollouter's shuffle of the task indices with the run's
   seed: ``e1-t<index>``); ``metrics.jsonl`` holds every step once; steps logged before the stop
   but after its checkpoint (trained twice in effect) are counted.

Writes ``OUT/faults.txt`` (what happened, the checks, PASS/FAIL) and ``OUT/faults.json``; exit 0
only if every check passed. Every phase has a deadline inside ``--total-s``; a phase past its
deadline has its whole session SIGKILLed and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ferryman.defaults.trackers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENGINE_TITLE = re.compile(rb"^ray::EngineActor\b")


def session_procs(sid: int) -> dict[int, bytes]:
    """Live processes of session ``sid``: pid -> command line (Ray workers: their process title)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # the fields after the command name (which may hold spaces): state, ppid, pgrp, session
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def kill_session(sid: int, wait_s: float = 30.0) -> list[int]:
    """SIGKILL every process of session ``sid`` until none is left; returns those still there."""
    deadline = time.time() + wait_s
    while True:
        left = session_procs(sid)
        if not left or time.time() > deadline:
            return sorted(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)


class Phase:
    """One ``ferryman train`` process in its own session, its output appended to ``log``."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.f = log.open("a")
        self.f.write(f"\n=== {' '.join(args)}\n")
        self.f.flush()
        self.t0 = time.time()
        self.p = subprocess.Popen([sys.executable, "-m", "ferryman.cli", *args], stdout=self.f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
        self.sid = self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def wait(self, deadline: float) -> int | None:
        """Exit status, or None if it was still running at ``deadline`` (then killed)."""
        while self.alive() and time.time() < deadline:
            time.sleep(0.5)
        rc = self.p.poll()
        left = kill_session(self.sid)
        if left:
            self.f.write(f"gpu_faults: processes of session {self.sid} survived SIGKILL: {left}\n")
        self.p.wait()
        self.f.close()
        return rc

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def expected_uids(seed: int, num_tasks: int, count: int) -> list[str]:
    """The sample ids the Rollouter admits first for ``seed`` (:meth:`Rollouter._next_task_index`:
    one shuffle of the task indices per epoch, epochs counted from 1)."""
    rng = random.Random(seed)
    out: list[str] = []
    epoch = 0
    while len(out) < count:
        order = list(range(num_tasks))
        rng.shuffle(order)
        epoch += 1
        out += [f"e{epoch}-t{i}" for i in order[: count - len(out)]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=str(ROOT / "examples" / "gpu" / "one_gpu.yaml"))
    ap.add_argument("--run-dir", default="/tmp/ferryman-gpu/faults")
    ap.add_argument("--steps", type=int, default=40, help="trainer steps of the whole run")
    ap.add_argument("--kill-at", type=int, default=10, help="SIGKILL a replica once this many steps are logged")
    ap.add_argument("--after-kill", type=int, default=10, help="steps the run must log after the kill before it is stopped")
    ap.add_argument("--total-s", type=float, default=540.0, help="deadline of the whole bench (seconds)")
    ap.add_argument("--grace-s", type=float, default=120.0, help="seconds a SIGTERMed run gets to checkpoint and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the run (e.g. model.path=...)")
    args = ap.parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.total_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.run_dir)
    log = out / "faults.log"
    if log.exists():
        log.unlink()
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)

    from ferryman.config import load_config
    from ferryman.plugins import PluginHost

    cfg, plugin_cfgs = load_config(args.config, [f"run_dir={run_dir}", *args.overrides], PluginHost())
    W = cfg.training.ppo_mini_batch_size
    total_samples = args.steps * W
    overrides = [
        f"run_dir={run_dir}",
        f"training.total_steps={args.steps}",
        f"rollout.total_rollout_steps={total_samples}",
        "checkpoint.on_sigterm=true",
        *args.overrides,
    ]
    report: dict = {"config": args.config, "overrides": overrides, "steps": args.steps, "samples_per_step": W,
                    "replicas": cfg.rollout.num_replicas, "events": []}
    checks: list[tuple[str, bool, str]] = []

    def event(what: str, **kw) -> None:
        kw = {"t_s": round(time.time() - t_start, 1), "what": what, **kw}
        report["events"].append(kw)
        print(json.dumps(kw), flush=True)

    def finish() -> int:
        ok = bool(checks) and all(c[1] for c in checks)
        report["checks"] = [{"check": c, "ok": k, "detail": d} for c, k, d in checks]
        report["passed"] = ok
        report["wall_s"] = round(time.time() - t_start, 1)
        (out / "faults.json").write_text(json.dumps(report, indent=1, default=str))
        lines = [f"gpu_faults: {args.config} {' '.join(overrides)}", ""]
        lines += [f"  {e['t_s']:7.1f} s  {e['what']}" + "".join(f", {k} {v}" for k, v in e.items() if k not in ("t_s", "what")) for e in report["events"]]
        lines.append("")
        lines += [f"  [{'ok' if k else 'FAIL'}] {c}: {d}" for c, k, d in checks]
        lines += ["", f"{'PASS' if ok else 'FAIL'} ({report['wall_s']:.0f} s)"]
        (out / "faults.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return 0 if ok else 1

    # 1-3: the run, a replica killed, the run going on
    first = Phase(["train", args.config, *overrides], log)
    event("run started", pid=first.sid)
    killed: int | None = None
    kill_step = None
    phase1_end = t_start + 0.55 * args.total_s  # the rest: the stop's checkpoint, the resume
    while first.alive() and time.time() < phase1_end:
        time.sleep(0.5)
        rows = read_metrics(run_dir)
        if killed is None and len(rows) >= args.kill_at:
            engines = sorted(pid for pid, cmd in session_procs(first.sid).items() if ENGINE_TITLE.match(cmd))
            if len(engines) != cfg.rollout.num_replicas:
                event("engine processes found", pids=engines, expected=cfg.rollout.num_replicas)
            if not engines:
                break
            killed, kill_step = engines[-1], len(rows)
            os.kill(killed, signal.SIGKILL)
            event("SIGKILL to an engine replica's actor", pid=killed, after_step=kill_step, engine_pids=engines)
        if killed is not None and len(rows) >= kill_step + args.after_kill and rows[-1].get("sync/lost_replicas", 0) >= 1:
            break
    rows = read_metrics(run_dir)
    checks.append(("a replica's actor was SIGKILLed during the run", killed is not None,
                   f"pid {killed} after step {kill_step}" if killed else f"no engine process found by step {len(rows)}"))
    lost = [r.get("sync/lost_replicas", 0) for r in rows[kill_step or 0:]]
    going_on = killed is not None and len(rows) >= (kill_step or 0) + args.after_kill and first.alive()
    if killed is not None:
        checks.append(("the replica is quarantined (sync/lost_replicas = 1 after the kill)", bool(lost) and max(lost) == 1,
                       f"sync/lost_replicas after the kill: {sorted(set(lost))}"))
    stopped_itself = not first.alive()
    if going_on:
        checks.append(("the run went on after the kill", True, f"{len(rows) - kill_step} steps logged after it, with one replica"))
        logged_before_stop = len(rows)
        first.p.send_signal(signal.SIGTERM)
        event("SIGTERM to the driver", after_step=logged_before_stop)
        rc1 = first.wait(min(time.time() + args.grace_s, deadline))
    else:
        rc1 = first.wait(min(time.time() + 5, deadline))
        logged_before_stop = len(rows)
        if stopped_itself:
            event("the run stopped by itself", rc=rc1)
    tail1 = first.tail(15)
    event("first part ended", rc=rc1, steps_logged=len(read_metrics(run_dir)))
    # `ferryman train` ends a stopped run with "...; checkpoint PATH; continue with: ...", a run
    # that died with "...; resume from PATH with: ferryman train --resume ..."
    m = re.search(r"on request; checkpoint ([^\s;]+)", tail1) or re.search(r"resume from (\S+) with", tail1)
    named = m.group(1) if m and Path(m.group(1)).is_dir() else None
    if going_on:
        checks.append(("SIGTERM: exit 75, the log names the checkpoint", rc1 == 75 and named is not None, f"exit {rc1}, checkpoint {named}"))
    else:
        checks.append(("the run stopped by itself naming its checkpoint", stopped_itself and named is not None,
                       f"exit {rc1}; last lines:\n{tail1}"))
    s1 = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    if killed is not None:
        checks.append(("the summary names the lost replica", len(s1.get("lost_replicas") or []) == 1, f"lost_replicas {s1.get('lost_replicas')}"))
    ck_step = None
    if s1.get("checkpoints"):
        ck_step = s1["checkpoints"][-1].get("step")
    if named is None:
        return finish()

    # 5: the resume
    second = Phase(["train", "--resume", str(run_dir)], log)
    event("resume started", pid=second.sid)
    rc2 = second.wait(deadline - 15)
    event("resume ended", rc=rc2)
    checks.append(("ferryman train --resume finished (exit 0)", rc2 == 0, f"exit {rc2}; last lines:\n{second.tail(6)}" if rc2 != 0 else "exit 0"))
    if rc2 != 0:
        return finish()

    # 6: nothing lost, nothing trained twice
    s = json.loads((run_dir / "summary.json").read_text())
    steps = [st["step"] for st in s.get("steps", [])]
    checks.append(("the summary holds steps 1..N each once", steps == list(range(1, args.steps + 1)),
                   f"{len(steps)} steps" + ("" if steps == list(range(1, args.steps + 1)) else f": {steps}")))
    uids = [u for st in s.get("steps", []) for u in st["sample_uids"]]
    twice = sorted({u for u in uids if uids.count(u) > 1})
    checks.append(("no sample trained twice", not twice, f"{len(uids)} samples trained" + (f"; twice: {twice}" if twice else "")))
    want = set(expected_uids(cfg.seed, plugin_cfgs["env"].num_tasks, total_samples))
    lost_uids = sorted(want - set(uids))
    extra = sorted(set(uids) - want)
    checks.append(("no sample lost: the trained samples are the admission order's first N x W", not lost_uids and not extra,
                   f"{len(want)} expected" + (f"; missing {lost_uids}" if lost_uids else "") + (f"; unexpected {extra}" if extra else "")))
    mrows = read_metrics(run_dir)
    msteps = [r["step"] for r in mrows]
    checks.append(("metrics.jsonl holds every step once", msteps == list(range(1, args.steps + 1)), f"{len(msteps)} rows"))
    resumed = s.get("resumed") or {}
    redone = max(0, logged_before_stop - int(resumed.get("step", logged_before_stop)))
    checks.append(("no step trained before the stop was trained again (the checkpoint was cut after the last logged step)", redone == 0,
                   f"resumed at step {resumed.get('step')} (checkpoint step {ck_step}), {logged_before_stop} steps logged before the stop"))
    after = [r.get("sync/lost_replicas", 0) for r in mrows if r["step"] > int(resumed.get("step", 0))]
    checks.append(("the resumed run has every replica back", bool(after) and max(after) == 0 and not s.get("lost_replicas"),
                   f"sync/lost_replicas after the resume: {sorted(set(after))}; lost_replicas {s.get('lost_replicas')}"))
    report["resumed"] = resumed
    return finish()


if __name__ == "__main__":
    sys.exit(main())
