"""The hostile-task suite as a report: every attack of ``packages/env-harbor/tests/hostile`` run
as a real Harbor Trial (oracle agent = the attack) in the namespace sandbox, with what happened
and how long containing it took. Writes ``bench/results/sandbox_security.md``.

    flock /tmp/ferryman-heavy.lock .venv/bin/python bench/sandbox_security.py

Time to contain: for a limit breach, from the start of the attack (the agent phase) to the
trial's error; for processes left running, how long ``stop`` takes until none is left; for the
rest, the attack's whole run (every step refused as it came)."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "env-harbor"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig  # noqa: E402
from harbor.trial.trial import Trial  # noqa: E402

from ferryman_env_harbor.config import SANDBOX_IMPORT_PATH  # noqa: E402
from ferryman_env_harbor.contain import LIMIT_ERROR_POLICY  # noqa: E402
from tests.conftest import processes_under  # noqa: E402
from tests.hostile_helpers import (  # noqa: E402
    EXPECTED,
    HOSTILE,
    TASKS,
    check_limit_in_force,
    env_kwargs,
    host_snapshot,
    listening_port,
    probe_env,
)

WHAT = {
    "fork-bomb": "`bomb() { bomb \\| bomb & }; bomb`",
    "memory-hog": "allocate 1 GiB (task: memory_mb 64, storage_mb 16)",
    "disk-fill": "`dd` 512 MiB (task: storage_mb 16)",
    "ignore-sigterm": "leave processes ignoring TERM/HUP/INT",
    "kill-all": "`kill -9 -1`",
    "loopback-scan": "connect to every TCP port of 127.0.0.1 (and ::1 1–4096)",
    "other-session": "requests to another session's proxy URL, path tricks, proxy root",
    "host-writes": "write /root, /tmp/ray, /work, /etc, /usr, /proc/sys, sysrq; mount; mknod; chroot escape",
    "tamper-tests": "edit /tests, plant conftest.py, pre-write reward.json, daemon rewriting them",
}


async def run_one(task: str, tmp: Path, sandbox_dir: Path, server, **extra) -> dict:
    agent_env = {}
    if task == "other-session":
        from ferryman.types import SamplingParams

        own = server.open_session("bench", SamplingParams(max_tokens=4))
        victim = server.open_session("victim", SamplingParams(max_tokens=4))
        agent_env = {"OPENAI_BASE_URL": own.base_url, "FERRYMAN_VICTIM_URL": victim.base_url}
        extra = {**extra, "proxy_url": own.base_url}
    cfg = TrialConfig(task=TaskConfig(path=HOSTILE / task), trials_dir=tmp / "trials",
                      agent=AgentConfig(name="oracle", env=agent_env),
                      environment=EnvironmentConfig(import_path=SANDBOX_IMPORT_PATH, kwargs=env_kwargs(sandbox_dir, **extra)),
                      override_error_policy=LIMIT_ERROR_POLICY)
    before = host_snapshot()
    trial = await Trial.create(cfg)
    t0 = time.monotonic()
    result = await trial.run()
    wall = time.monotonic() - t0
    ae = result.agent_execution
    agent_s = (ae.finished_at - ae.started_at).total_seconds() if ae and ae.finished_at else float("nan")
    exc = result.exception_info
    rewards = result.verifier_result.rewards if result.verifier_result else None
    out = {"task": task, "exception": exc.exception_type if exc else None,
           "message": (exc.exception_message if exc else ""), "reward": rewards, "valid": result.reward_valid,
           "agent_s": agent_s, "wall_s": wall, "host_same": host_snapshot() == before,
           "left": len(processes_under(sandbox_dir))}
    if task == "other-session":
        vres = await server.close_session(victim)
        await server.close_session(own)
        out["victim_requests"] = len(vres.trajectories)
    return out


async def stop_time(task: str, tmp: Path, sandbox_dir: Path) -> float:
    """Run the attack in a bare sandbox, then time ``stop`` until no process is left."""
    env = probe_env(task, sandbox_dir, tmp)
    await env.start(force_build=False)
    await env.upload_dir(HOSTILE / task / "solution", "/solution")
    await env.exec("bash /solution/solve.sh")
    assert processes_under(sandbox_dir)
    t0 = time.monotonic()
    await env.stop(delete=True)
    while processes_under(sandbox_dir):
        await asyncio.sleep(0.001)
    return time.monotonic() - t0


async def costs(tmp: Path, sandbox_dir: Path) -> list[str]:
    """Start, exec and stop of a contained sandbox and of one without containment
    (``enforce_limits: false, network: host``), side by side in this run."""
    import statistics

    from tests.test_sandbox import make_env

    out = {}
    for label, kw in (("contained", {}), ("uncontained", {"enforce_limits": False, "network": "host"})):
        starts, execs, stops = [], [], []
        for i in range(8):
            d = tmp / f"cost-{label}-{i}"
            d.mkdir()
            env = make_env(d, sandbox_dir, "FROM scratch\n", session=f"cost{i}__env", **kw)
            t0 = time.perf_counter()
            await env.start(force_build=False)
            starts.append(time.perf_counter() - t0)
            for _ in range(10):
                t0 = time.perf_counter()
                await env.exec("true")
                execs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await env.stop(delete=True)
            stops.append(time.perf_counter() - t0)
        out[label] = [1e3 * statistics.median(x) for x in (starts, execs, stops)]
    c, u = out["contained"], out["uncontained"]
    return ["", "Costs (medians of 8 sandboxes × 10 execs, same run, ms):", "",
            "| | start | exec `true` | stop |", "|---|---|---|---|",
            f"| contained | {c[0]:.0f} | {c[1]:.1f} | {c[2]:.0f} |", f"| uncontained | {u[0]:.0f} | {u[1]:.1f} | {u[2]:.0f} |",
            f"| ratio | {c[0] / u[0]:.2f} | {c[1] / u[1]:.2f} | {c[2] / u[2]:.2f} |"]


async def main() -> None:
    from transformers import AutoTokenizer

    from ferryman.tiny import build_tiny_model
    from ferryman_proxy import ProxyServer
    from tests.harbor_helpers import scripted_client

    tmp = Path(tempfile.mkdtemp(prefix="ferryman-sbx-bench-"))
    sandbox_dir = tmp / "sandboxes"
    sandbox_dir.mkdir()
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp / "tiny"))
    client, _ = scripted_client(tok, ["ok"])
    server = ProxyServer(tokenizer=tok, client=client)
    await server.start()
    service = listening_port()
    sentinel = subprocess.Popen(["sleep", "600"])
    rows = []
    try:
        for task in TASKS:
            await check_limit_in_force(task, sandbox_dir, tmp)
            rows.append(await run_one(task, tmp, sandbox_dir, server))
            print(rows[-1], flush=True)
        sig_stop = await stop_time("ignore-sigterm", tmp, sandbox_dir)
        unguarded = await run_one("tamper-tests", tmp, sandbox_dir, server, fresh_tests=False)
        sentinel_alive = sentinel.poll() is None
        cost_lines = await costs(tmp, sandbox_dir)
    finally:
        sentinel.kill()
        sentinel.wait()
        service.close()
        await server.stop()
    lines = [
        "# Sandbox security: the hostile-task suite",
        "",
        "Every attack is a Harbor task in `packages/env-harbor/tests/hostile/` whose oracle solution is the",
        "attack, run as a real Harbor Trial (`Trial.create` / `run`) in `NamespaceEnvironment` with",
        f"`pids_limit: 64`, before each the check that its limit is in force. Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other jobs, kernel {platform.release()}, cgroup v1 (memory, pids, cpu).",
        "",
        "Command: `flock /tmp/ferryman-heavy.lock .venv/bin/python bench/sandbox_security.py` (this run:",
        "`nice -n 10 .venv/bin/python bench/sandbox_security.py`, the lock being queued behind full test suites;",
        "the attacks are bounded by their own limits). Times are one run each on a loaded machine.",
        "",
        "| attack | what it does | outcome | reward | host unchanged | time to contain |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["exception"]:
            outcome = f"`{r['exception']}`: {r['message'][:90]}"
            contain = f"{r['agent_s']:.2f} s from attack start to the error"
        else:
            outcome = "graded, contained"
            contain = f"{r['agent_s']:.2f} s (whole attack; each step refused at once)"
        if r["task"] == "ignore-sigterm":
            contain = f"stop: {sig_stop * 1e3:.0f} ms until no process left (SIGKILL of the namespace's init)"
        if r["task"] == "other-session":
            outcome += f"; victim session saw {r['victim_requests']} requests"
        if r["task"] == "kill-all":
            outcome += f"; host sentinel process alive: {sentinel_alive}"
        reward = "invalid (not trained)" if not r["valid"] else str((r["reward"] or {}).get("reward"))
        lines.append(f"| {r['task']} | {WHAT[r['task']]} | {outcome} | {reward} | {r['host_same'] and r['left'] == 0} | {contain} |")
    lines += [
        "",
        f"Without the verify-time barrier (`fresh_tests: false`) the tampering attack scores "
        f"**{(unguarded['reward'] or {}).get('reward')}**; with it (default) "
        f"**{(next(r for r in rows if r['task'] == 'tamper-tests')['reward'] or {}).get('reward')}**.",
        "",
        "Expected outcomes: " + ", ".join(f"{k} → `{v}`" for k, v in EXPECTED.items())
        + "; every other attack graded 0. 'host unchanged': no file the attacks write appeared on the host, "
        "/etc/passwd and the hostname are the same, and no process of the sandbox is left.",
    ]
    lines += cost_lines
    out = ROOT / "bench" / "results" / "sandbox_security.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
