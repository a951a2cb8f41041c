"""The hostile-task suite: each attack is a Harbor task (``tests/hostile/*``) whose oracle
solution is the attack, run as a real Harbor Trial in the namespace sandbox. Each must be
contained: the trial fails with the limit's error or scores 0, the host is unchanged, nothing
of the sandbox is left. Each test first checks that what contains its attack is in force, so a
regression fails the test instead of harming the machine.

The same tasks run through Harbor's CLI (``harbor run``) and through ``ferryman train`` in the
``slow`` tests below."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

from ferryman_env_harbor.config import SANDBOX_IMPORT_PATH
from ferryman_env_harbor.contain import LIMIT_ERROR_POLICY

from .conftest import processes_under
from .harbor_helpers import scripted_client
from .hostile_helpers import EXPECTED, HOSTILE, TASKS, check_limit_in_force, env_kwargs, host_snapshot, listening_port

ROOT = Path(__file__).resolve().parents[3]


async def run_hostile(task: str, tmp_path: Path, sandbox_dir: Path, agent_env: dict[str, str] | None = None, **extra):
    cfg = TrialConfig(
        task=TaskConfig(path=HOSTILE / task),
        trials_dir=tmp_path / "trials",
        agent=AgentConfig(name="oracle", env=agent_env or {}),
        environment=EnvironmentConfig(import_path=SANDBOX_IMPORT_PATH, kwargs=env_kwargs(sandbox_dir, **extra)),
        override_error_policy=LIMIT_ERROR_POLICY,
    )
    trial = await Trial.create(cfg)
    t0 = time.monotonic()
    result = await trial.run()
    return result, time.monotonic() - t0


def check_contained(task: str, result, before: dict) -> None:
    exc = result.exception_info
    if task in EXPECTED:
        assert exc is not None and exc.exception_type == EXPECTED[task], exc
        assert "limit exceeded" in exc.exception_message
        assert not result.reward_valid and not exc.policy.should_grade
    else:
        assert exc is None, exc
        assert result.reward_valid and result.verifier_result.rewards == {"reward": 0.0}, result.verifier_result
    assert host_snapshot() == before


@pytest.mark.parametrize("task", sorted(set(TASKS) - {"other-session", "loopback-scan", "kill-all"}))
async def test_hostile_task_is_contained(task, tmp_path, sandbox_dir):
    await check_limit_in_force(task, sandbox_dir, tmp_path)
    before = host_snapshot()
    result, _ = await run_hostile(task, tmp_path, sandbox_dir)
    check_contained(task, result, before)


async def test_kill_minus_one_kills_only_the_sandbox(tmp_path, sandbox_dir):
    await check_limit_in_force("kill-all", sandbox_dir, tmp_path)
    sentinel = subprocess.Popen(["sleep", "120"])
    try:
        before = host_snapshot()
        result, _ = await run_hostile("kill-all", tmp_path, sandbox_dir)
        check_contained("kill-all", result, before)
        assert sentinel.poll() is None, "a host process was killed"
    finally:
        sentinel.kill()
        sentinel.wait()


async def test_loopback_scan_finds_nothing_of_the_host(tmp_path, sandbox_dir):
    await check_limit_in_force("loopback-scan", sandbox_dir, tmp_path)
    service = listening_port()
    try:
        before = host_snapshot()
        result, _ = await run_hostile("loopback-scan", tmp_path, sandbox_dir)
        check_contained("loopback-scan", result, before)
        # the service is still reachable from the host: the scan was cut off, not the service
        service.settimeout(1)
        import socket

        socket.create_connection(service.getsockname(), timeout=1).close()
    finally:
        service.close()


async def test_another_sessions_proxy_url_is_refused(tokenizer, tmp_path, sandbox_dir):
    """The sandbox gets its own session through the forwarder; the victim's URL (given to the
    attack as if it had leaked) and every path outside the own prefix are refused, and the
    victim's session sees no request."""
    from ferryman.types import SamplingParams
    from ferryman_proxy import ProxyServer

    client, _ = scripted_client(tokenizer, ["ok"])
    server = ProxyServer(tokenizer=tokenizer, client=client)
    await server.start()
    try:
        own = server.open_session("attacker", SamplingParams(max_tokens=8))
        victim = server.open_session("victim", SamplingParams(max_tokens=8))
        await check_limit_in_force("other-session", sandbox_dir, tmp_path, proxy_url=own.base_url)
        before = host_snapshot()
        result, _ = await run_hostile("other-session", tmp_path, sandbox_dir,
                                      agent_env={"OPENAI_BASE_URL": own.base_url, "FERRYMAN_VICTIM_URL": victim.base_url},
                                      proxy_url=own.base_url)
        check_contained("other-session", result, before)
        codes = (Path(result.trial_uri.removeprefix("file://")) / "verifier" / "codes.txt").read_text().splitlines()
        assert codes[0] == f"200 {own.base_url}/models", codes  # the own session is reachable through the forwarder
        refused = [c for c in codes[1:] if not c.startswith("403 ")]
        assert not refused, refused  # every other attempt: the forwarder's 403
        vres = await server.close_session(victim)
        assert vres.trajectories == [] and vres.metrics.get("proxy/bad_requests", 0) == 0
        ores = await server.close_session(own)
        assert ores.metrics.get("proxy/bad_requests", 0) == 0
    finally:
        await server.stop()


# ---------------------------------------------------------------------------- the CLI and ferryman train
@pytest.mark.slow
async def test_suite_through_harbors_cli(tokenizer, tmp_path, sandbox_dir):
    """``harbor run -p tests/hostile -a oracle -e …NamespaceEnvironment``: every trial
    contained (the CLI has no ferryman override for the pids/storage errors: those trials show
    the error and score 0)."""
    from ferryman.types import SamplingParams
    from ferryman_proxy import ProxyServer

    for task in TASKS:
        await check_limit_in_force(task, sandbox_dir, tmp_path)
    client, _ = scripted_client(tokenizer, ["ok"])
    server = ProxyServer(tokenizer=tokenizer, client=client)
    await server.start()
    service = listening_port()
    sentinel = subprocess.Popen(["sleep", "300"])
    try:
        own = server.open_session("cli", SamplingParams(max_tokens=8))
        victim = server.open_session("victim", SamplingParams(max_tokens=8))
        before = host_snapshot()
        harbor = Path(sys.executable).with_name("harbor")
        argv = [str(harbor), "run", "-p", str(HOSTILE), "-a", "oracle", "-e", SANDBOX_IMPORT_PATH,
                "--ek", f"sandbox_dir={sandbox_dir}", "--ek", "pids_limit=64", "--ek", f"proxy_url={own.base_url}",
                "--ae", f"OPENAI_BASE_URL={own.base_url}", "--ae", f"FERRYMAN_VICTIM_URL={victim.base_url}",
                "-n", "2", "-o", str(tmp_path / "jobs"), "-q"]
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
        results = {}
        for path in (tmp_path / "jobs").glob("*/*/result.json"):
            data = json.loads(path.read_text())
            results[data["task_name"]] = data
        assert sorted(results) == TASKS, out.decode(errors="replace")[-3000:]
        for task, data in results.items():
            exc = data.get("exception_info")
            rewards = (data.get("verifier_result") or {}).get("rewards")
            if task in EXPECTED:
                assert exc and exc["exception_type"] == EXPECTED[task], (task, exc)
                assert not rewards or rewards.get("reward") == 0.0, (task, rewards)
            else:
                assert exc is None, (task, exc)
                assert rewards == {"reward": 0.0}, (task, rewards)
        assert host_snapshot() == before
        assert sentinel.poll() is None
        vres = await server.close_session(victim)
        assert vres.trajectories == []
    finally:
        sentinel.kill()
        sentinel.wait()
        service.close()
        await server.stop()
    assert not processes_under(sandbox_dir)


@pytest.mark.slow
def test_suite_through_ferryman_train(tmp_path, sandbox_dir, monkeypatch):
    """``ferryman train`` (inline runtime, tiny model) on the hostile tasks: the agent makes one
    LLM call through the proxy, then runs the attack. Limit breaches are masked (``on_invalid:
    mask``), the others score 0; the run completes its steps and the host is unchanged."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from ferryman.config import load_config
    from ferryman.plugins import PluginHost
    from ferryman.runner import run

    sentinel = subprocess.Popen(["sleep", "300"])
    before = host_snapshot()
    steps = 2
    tasks = [str(HOSTILE / t) for t in TASKS if t != "other-session"]
    try:
        cfg, _ = load_config(
            str(ROOT / "examples" / "harbor" / "train.yaml"),
            [
                "runtime=inline",
                f"run_dir={tmp_path / 'run'}",
                f"model.path={tmp_path / 'model'}",
                "model.tiny_max_positions=512",
                "rollout.n=2",
                f"training.total_steps={steps}",
                "training.ppo_mini_batch_size=2",
                f"env.tasks={json.dumps(tasks)}",
                "env.agent={import_path: hostile_agent:AttackAgent}",
                "env.on_invalid=mask",
                "env.proxy={max_total_tokens: 512}",
                f"env.environment={{import_path: {SANDBOX_IMPORT_PATH}, kwargs: {{sandbox_dir: {sandbox_dir}, pids_limit: 64}}}}",
                "trackers=[{type: jsonl}]",
            ],
            PluginHost(),
        )
        summary = run(cfg)
        assert len(summary["steps"]) == steps
        stats = summary["rollouter"]
        assert stats["harbor/trials"] >= steps * 2
        assert stats.get("harbor/reward_mean", 0.0) == 0.0
        assert host_snapshot() == before
        assert sentinel.poll() is None
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()
    assert not processes_under(sandbox_dir)
