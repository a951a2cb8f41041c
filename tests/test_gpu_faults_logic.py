"""bench/gpu_faults.py's bookkeeping: the sample ids it expects are the Rollouter's own admission
order, and its session helpers find and kill every process of a session (Ray's workers, which
have process groups of their own, included)."""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def test_expected_uids_follow_the_rollouters_admission_order():
    from ferryman.rollouter import Rollouter
    from ferryman.types import SamplingParams

    expected_uids = runpy.run_path(str(ROOT / "bench" / "gpu_faults.py"))["expected_uids"]
    for seed, num_tasks, count in ((0, 1000, 40), (5, 7, 17)):  # (5, 7, 17): three epochs
        r = Rollouter(env=SimpleNamespace(num_tasks=lambda n=num_tasks: n), client=None, queue=None, n=1,
                      sampling=SamplingParams(), max_required_samples=1, max_concurrent_samples=1, seed=seed)
        got = []
        for _ in range(count):
            got.append(r.sample_uid(r._next_task_index()))
        assert got == expected_uids(seed, num_tasks, count)


def test_session_helpers_kill_a_child_in_its_own_process_group():
    mod = runpy.run_path(str(ROOT / "bench" / "gpu_faults.py"))
    # a session leader whose child moves to a process group of its own, like a Ray worker
    code = "import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)']); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        # wait until the child has started and run its setpgid (a loaded machine takes a while
        # to start a Python; a CI run once saw the child before it had moved)
        def moved_child() -> int | None:
            procs = mod["session_procs"](p.pid)
            for pid in procs:
                if pid != p.pid:
                    with contextlib.suppress(ProcessLookupError):
                        if os.getpgid(pid) != os.getpgid(p.pid):
                            return pid
            return None

        deadline = time.time() + 30
        while moved_child() is None and time.time() < deadline:
            time.sleep(0.1)
        procs = mod["session_procs"](p.pid)
        assert len(procs) == 2 and p.pid in procs
        assert moved_child() is not None, "the child never moved to a process group of its own"
        assert mod["kill_session"](p.pid) == []
        p.wait(timeout=10)
        assert mod["session_procs"](p.pid) == {}
    finally:
        if p.poll() is None:
            p.kill()
