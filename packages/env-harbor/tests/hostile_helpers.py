"""The hostile-task suite's shared parts (used by ``test_hostile.py`` and
``bench/sandbox_security.py``): the tasks, the environment options they run under, the check
that a task's limit is in force before its attack runs, and host-side snapshots.

Small limits on purpose (the machine is shared): the fork bomb meets a pids limit of 64, the
memory hog 64 MiB (+16 MiB storage), the disk fill 16 MiB of storage."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

from ferryman_env_harbor.contain import MiB
from ferryman_env_harbor.sandbox import NamespaceEnvironment

HOSTILE = Path(__file__).parent / "hostile"
TASKS = sorted(p.name for p in HOSTILE.iterdir() if (p / "task.toml").is_file())
PIDS_LIMIT = 64

EXPECTED: dict[str, str] = {
    "fork-bomb": "PidsLimitExceededError",
    "memory-hog": "MemoryLimitExceededError",
    "disk-fill": "StorageLimitExceededError",
}
"""Attacks that must fail the trial with this exception; every other one must be graded 0."""

HOST_PATHS = ["/root/ferryman-breach", "/tmp/ray/ferryman-breach", "/work/ferryman-breach", "/etc/ferryman-breach",
              "/usr/local/ferryman-breach", "/proc/sys/kernel/hostname"]


def env_kwargs(sandbox_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"sandbox_dir": str(sandbox_dir), "pids_limit": PIDS_LIMIT, **extra}


def probe_env(task: str, sandbox_dir: Path, tmp_path: Path, **extra: Any) -> NamespaceEnvironment:
    """A sandbox made as a Trial would make it for ``task``."""
    t = Task(HOSTILE / task)
    trial_dir = tmp_path / f"probe-{task}"
    trial_dir.mkdir(parents=True, exist_ok=True)
    return NamespaceEnvironment(
        environment_dir=t.paths.environment_dir, environment_name=task, session_id=f"probe-{task}__env",
        trial_paths=TrialPaths(trial_dir=trial_dir), task_env_config=t.config.environment,
        **env_kwargs(sandbox_dir, **extra),
    )


async def check_limit_in_force(task: str, sandbox_dir: Path, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """Start the task's sandbox and check, from the host and from inside, that what contains
    its attack is in force; raises AssertionError (before any attack ran) if not."""
    env = probe_env(task, sandbox_dir, tmp_path, **extra)
    await env.start(force_build=False)
    try:
        cg = env.cgroup
        assert cg is not None, "no cgroup: limits are not enforced"
        lim = env.resolved_limits()
        held = cg.in_force()
        assert held["pids"] == lim.pids == PIDS_LIMIT, held
        assert held["memory_bytes"] == lim.memory_bytes, held
        assert abs(held["cpus"] - lim.cpus) < 1e-9, held
        r = await env.exec("df -k / | tail -1; readlink /proc/self/ns/net /proc/self/ns/pid; ip -o route; "
                           "grep CapBnd /proc/self/status; cat /proc/self/mountinfo")
        lines = (r.stdout or "").splitlines()
        size_kib = int(lines[0].split()[1])
        assert size_kib == lim.storage_mb * 1024, lines[0]
        assert lines[1] != os.readlink("/proc/self/ns/net"), "the sandbox shares the host's network namespace"
        assert lines[2] != os.readlink("/proc/self/ns/pid"), "the sandbox shares the host's pid namespace"
        assert not any(line.strip().startswith(("default", "10.", "192.")) for line in lines[3:]), "a route out exists"
        cap_line = next(line for line in lines if line.startswith("CapBnd"))
        assert int(cap_line.split()[1], 16) & (1 << 21) == 0, "CAP_SYS_ADMIN is not dropped"
        assert not any(" /work" in line or "/tmp/ray" in line for line in lines), "a host directory is mounted"
        ro = [line for line in lines if " /proc/sys " in line]
        assert ro and ro[0].split()[5].split(",")[0] == "ro", ro
        return {"limits": lim, "in_force": held, "storage_kib": size_kib}
    finally:
        await env.stop(delete=True)


HOST_MARKER = Path("/tmp/ferryman-host-marker")
"""A host file an attack that escaped the sandbox's root would see (host-writes looks for it)."""


def host_snapshot() -> dict[str, Any]:
    """What the attacks must not change on the host (and the marker they must not see)."""
    HOST_MARKER.write_text("host\n")
    return {
        "paths": {p: os.path.exists(p) for p in HOST_PATHS if not p.startswith("/proc")},
        "passwd": hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest(),
        "hostname": socket.gethostname(),
    }


def listening_port() -> socket.socket:
    """A host service on the loopback that the scan must not find."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


__all__ = ["EXPECTED", "HOSTILE", "MiB", "PIDS_LIMIT", "TASKS", "check_limit_in_force", "env_kwargs", "host_snapshot",
           "listening_port", "probe_env"]
