"""``ferryman train`` with a third-party env that is broken (registered with FERRYMAN_PLUGINS, as
a user would try a module that is not installed): it stops by itself with exit 1 and the first
failure's traceback, within a bounded time and a bounded log, and trains nothing on garbage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BROKEN = '''
from typing import Literal

import ferryman
from ferryman.config import PluginConfig
from ferryman.specs import EnvSpec
from ferryman.types import Trajectory


class BrokenConfig(PluginConfig):
    type: Literal["broken"] = "broken"
    how: Literal["raise", "nan"] = "raise"


class BrokenEnv:
    def __init__(self, how):
        self.how = how

    @classmethod
    def from_config(cls, config, **_):
        return cls(config.how)

    def num_tasks(self):
        return 5

    def get_task(self, index):
        return {"start": 10 + index}

    async def run(self, task, request_id, client, params):
        if self.how == "raise":
            raise RuntimeError("my env is broken: " + str(task["start"]))
        traj = Trajectory(request_id=request_id, prompt_ids=[task["start"]])
        traj.append_model_tokens(await client.generate(request_id, traj.prompt_ids, params))
        traj.reward = float("nan")
        return traj


@ferryman.hookimpl
def ferryman_register_envs():
    return [EnvSpec("broken", BrokenEnv.from_config, BrokenConfig, "an env that fails")]
'''


def _train(tmp_path: Path, tiny_model: Path, *overrides: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "broken_env.py").write_text(textwrap.dedent(BROKEN))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FERRYMAN_PLUGINS": "broken_env"}
    cmd = [
        sys.executable, "-m", "ferryman.cli", "train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}",
        "runtime=inline", "rollout.n=2", "rollout.max_tokens=2", "rollout.num_replicas=1", "training.ppo_mini_batch_size=2",
        "training.total_steps=5", "env={type: broken}", "trackers=[{type: jsonl}, {type: console}]", *overrides,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.timeout(300)
def test_an_always_failing_env_stops_the_run_with_its_traceback(tmp_path, tiny_model):
    proc, wall = _train(tmp_path, tiny_model)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    # before: no exit at all, ~280k lines a minute; now: a few lines and out, well within a minute
    # of the run's start (start-up dominates on a busy 2-core machine)
    assert wall < 120, wall
    assert len(log) < 20_000 and log.count("\n") < 150, log[-3000:]
    assert "agent runs are failing systematically: 100 agent runs in a row failed" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and "RuntimeError: my env is broken" in proc.stderr
    assert "no checkpoint was saved" in proc.stderr and "(no checkpoint yet)" not in proc.stderr
    trace_bytes = sum(p.stat().st_size for p in (tmp_path / "run" / "trace").rglob("*") if p.is_file())
    assert trace_bytes < 500_000, trace_bytes
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "failing systematically" in summary["error"]


@pytest.mark.timeout(300)
def test_nan_rewards_are_refused_and_the_run_stops(tmp_path, tiny_model):
    proc, _ = _train(tmp_path, tiny_model, "env.how=nan", "rollout.failures.max_consecutive=20")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "20 agent runs in a row failed" in proc.stderr and "'nonfinite_reward': " in proc.stderr
    assert "with reward nan: not finite" in proc.stderr
    assert "finished" not in proc.stdout and "step    1" not in proc.stdout, "not one step trained on a NaN reward"
