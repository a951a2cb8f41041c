"""A throwaway third-party env plugin, outside the workspace (its own pyproject.toml and entry
point in group ``ferryman``), installed into a fresh virtual environment: ferryman discovers it
and it passes core's EnvContract there. This is exactly what docs/writing-a-plugin.md describes."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYPROJECT = """
[project]
name = "ferryman-env-countdown"
version = "0.3.1"
requires-python = ">=3.12"
dependencies = ["ferryman>=0.1,<0.2"]

[project.entry-points.ferryman]
env_countdown = "ferryman_env_countdown.hooks"

[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[tool.setuptools.packages.find]
where = ["src"]
"""

HOOKS = '''
import ferryman
from ferryman.specs import EnvSpec


@ferryman.hookimpl
def ferryman_register_envs():
    from ferryman_env_countdown.env import CountdownEnv, CountdownConfig

    return [EnvSpec("countdown", CountdownEnv.from_config, CountdownConfig, "count down by one")]
'''

ENV = '''
from typing import Literal

from ferryman.config import PluginConfig
from ferryman.types import Trajectory


class CountdownConfig(PluginConfig):
    type: Literal["countdown"] = "countdown"
    num_tasks: int = 5


class CountdownEnv:
    def __init__(self, n):
        self.n = n

    @classmethod
    def from_config(cls, config, **_):
        return cls(config.num_tasks)

    def num_tasks(self):
        return self.n

    def get_task(self, index):
        return {"start": 10 + index}

    async def run(self, task, request_id, client, params):
        traj = Trajectory(request_id=request_id, prompt_ids=[task["start"]])
        out = await client.generate(request_id, traj.prompt_ids, params)
        traj.append_model_tokens(out)
        traj.reward = 1.0 if out.token_ids and out.token_ids[0] == task["start"] + 1 else 0.0
        return traj
'''

CONTRACT_TEST = '''
import pytest

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.testing import EnvContract
from ferryman.testing.doubles import EchoEngine
from ferryman_env_countdown.env import CountdownEnv


class TestCountdownEnv(EnvContract):
    @pytest.fixture
    def env(self):
        return CountdownEnv(5)

    @pytest.fixture
    def client(self):
        engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
        return ServerClient(LocalRouter(["r0"]), engines, partial_rollout=False)
'''


def _write(root: Path) -> None:
    pkg = root / "src" / "ferryman_env_countdown"
    pkg.mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    (pkg / "hooks.py").write_text(HOOKS)
    (pkg / "env.py").write_text(ENV)
    (root / "tests").mkdir()
    (root / "tests" / "test_contract.py").write_text(CONTRACT_TEST)


@pytest.mark.slow
def test_third_party_env_plugin_is_discovered_and_passes_contract(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is needed to build a fresh environment")
    plugin = tmp_path / "ferryman-env-countdown"
    _write(plugin)
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    # the fresh env sees this environment's packages (ferryman, torch, pytest …) read-only,
    # and gets the plugin installed into itself only
    purelib = subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    # (addsitedir also processes the parent's .pth files: editable workspace installs)
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
    Path(purelib, "_parent_env.pth").write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run([uv, "pip", "install", "-q", "--python", str(py), "--no-deps", str(plugin)], check=True, env=env)

    listing = subprocess.run([str(py), "-m", "ferryman.cli", "plugins"], capture_output=True, text=True, env=env, check=True).stdout
    assert "ferryman-env-countdown 0.3.1" in listing
    assert "countdown" in listing

    owner = subprocess.check_output(
        [str(py), "-c", "from ferryman.plugins import PluginHost; print(PluginHost().owner('env', 'countdown').distribution)"],
        text=True,
        env=env,
    ).strip()
    assert owner == "ferryman-env-countdown"

    # and the plugin is not visible to this (the parent) environment: nothing leaked
    from ferryman.plugins import PluginHost

    assert "countdown" not in PluginHost().specs("env")

    res = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto", str(plugin / "tests")],
        capture_output=True,
        text=True,
        env=env,
        cwd=plugin,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 passed" in res.stdout
