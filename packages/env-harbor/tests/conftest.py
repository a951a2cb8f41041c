"""Fixtures: task directories, a sandbox factory, and a leak check for sandbox processes and
directories (scoped to each test's own sandbox directory, so other work on the machine does not
interfere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harbor_helpers import client_for

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

HERE = Path(__file__).parent
EXAMPLE_TASKS = HERE.parents[2] / "examples" / "harbor" / "tasks"
TEST_TASKS = HERE / "tasks"


def processes_under(directory: Path) -> list[str]:
    """Processes whose root, cwd or command line lies in ``directory``, or that are in the cgroup
    of a sandbox made there (``pid: cmdline``)."""
    from ferryman_env_harbor.sandbox import cgroup_tag

    d = str(directory)
    tag = "/" + cgroup_tag(directory) + "-"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            links = []
            for name in ("root", "cwd"):
                try:
                    links.append(os.readlink(f"/proc/{entry}/{name}"))
                except OSError:
                    pass
            try:
                groups = open(f"/proc/{entry}/cgroup").read()
            except OSError:
                groups = ""
        except OSError:
            continue
        if d in cmd or any(link.startswith(d) for link in links) or tag in groups:
            found.append(f"{entry}: {cmd[:200]}")
    return found


@pytest.fixture
def sandbox_dir(tmp_path: Path):
    """A private directory for the test's sandboxes; after the test it must hold no sandbox
    and no process may live in it."""
    d = tmp_path / "sandboxes"
    d.mkdir()
    yield d
    leaked = processes_under(d)
    left = sorted(p.name for p in d.iterdir())
    assert not leaked, f"leaked sandbox processes: {leaked}"
    assert not left, f"leaked sandbox directories: {left}"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    """The tiny model (random weights) with 8192 positions, so terminus-2's long prompt fits."""
    from ferryman.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-8k", max_positions=8192)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture
async def hf_client(tiny_path):
    from ferryman_engine_hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(), model_path=str(tiny_path), seed=0)
    await engine.start()
    yield client_for(engine)
    await engine.shutdown()


@pytest.fixture
def example_tasks() -> Path:
    return EXAMPLE_TASKS


@pytest.fixture
def test_tasks() -> Path:
    return TEST_TASKS
