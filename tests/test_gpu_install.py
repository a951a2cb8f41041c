"""The one lock and the GPU machine's wheel set (tools/gpu_wheels.py, tools/gpu-install.sh).

The lock must be current with its extras; the wheels carried to the offline GPU machine must be
exactly the lock's export for the extra, less what that machine has at the locked version and
less the packages named (with reasons) in tools/gpu-not-carried.txt."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")
needs_uv = pytest.mark.skipif(UV is None, reason="uv is not on PATH")


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_wheels"] = mod
    spec.loader.exec_module(mod)
    return mod


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@needs_uv
def test_lock_is_current_with_the_gpu_extras():
    r = subprocess.run([UV, "lock", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_extras_are_declared_and_vllm_pins_the_workspace_torch():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "vllm" in root["project"]["optional-dependencies"]
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    torches = {p["version"] for p in lock["package"] if p["name"] == "torch"}
    vllms = {p["version"] for p in lock["package"] if p["name"] == "vllm"}
    assert vllms and all(v.startswith("0.24.") for v in vllms)
    # vLLM 0.24 pins torch 2.11.0: the CPU install uses the same torch as the GPU stack
    assert torches == {"2.11.0"}


@needs_uv
def test_carried_wheels_are_the_export_less_the_machine_and_the_named_optional_ones():
    tool = _tool()
    text = subprocess.run(
        [UV, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--extra", "vllm", "--group", "gpu-build"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    export = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req, _, marker = line.partition(";")
        env = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.12",
               "python_full_version": "3.12.3", "implementation_name": "cpython", "os_name": "posix",
               "platform_python_implementation": "CPython"}
        if marker.strip() and not Marker(marker).evaluate(env):
            continue  # not the GPU machine (Linux x86-64, CPython 3.12)
        name, _, version = req.strip().partition("==")
        export[_norm(name)] = version
    machine = {}
    for line in (ROOT / "tools" / "gpu-machine-packages.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            machine[_norm(name)] = version or None
    skipped, section = set(), "all"
    for line in (ROOT / "tools" / "gpu-not-carried.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and section in ("all", "vllm"):
            skipped.add(_norm(line))
    expected = {
        n: v for n, v in export.items() if not (n in machine and machine[n] in (None, v)) and n not in skipped
    }
    carried = dict(tool.carried("vllm"))
    assert carried == expected
    # the pieces that make the stack: vLLM, ferryman's own needs; torch comes from the machine
    for name in ("vllm", "ray", "pydantic", "pyzmq", "hatchling", "pytest-asyncio"):
        assert name in carried, name
    assert "torch" not in carried and machine["torch"] == export["torch"]
    # a package the machine has at another version is carried at the locked one
    assert carried["transformers"] == export["transformers"] != machine["transformers"]
    everything = dict(tool.carried("vllm", everything=True))
    assert set(everything) - set(carried) == skipped & set(export)


@needs_uv
def test_two_extras_carry_both_stacks_and_with_carries_a_named_optional_one():
    tool = _tool()
    vllm = dict(tool.carried("vllm"))
    both = dict(tool.carried(["vllm", "megatron"]))
    # megatron-core joins the vLLM set; nothing of the vLLM set is dropped
    assert "megatron-core" in both and "megatron-core" not in vllm
    assert set(vllm) <= set(both)
    # --with harbor --with litellm: exactly those two more (what they need is carried already)
    harbor = dict(tool.carried(["vllm", "megatron"], keep=["harbor", "LiteLLM"]))
    assert set(harbor) - set(both) == {"harbor", "litellm"}
    assert "supabase" not in harbor  # still left behind: not named
    with pytest.raises(SystemExit, match="--with not-a-package"):
        tool.carried("vllm", keep=["not-a-package"])

def test_pyzmq_is_carried_for_the_weight_syncs_default_channel():
    # the sync transports' default metadata channel is ZeroMQ; without pyzmq there they fall back
    # to the TCPStore (several round trips per bucket)
    tool = _tool()
    pins = tool.carried("vllm")
    assert [n for n, _ in tool.only(pins, "pyzmq")] == ["pyzmq"]
    with pytest.raises(SystemExit, match="not carried: no-such-wheel"):
        tool.only(pins, "pyzmq,no-such-wheel")


def test_pack_splits_big_wheels_and_keeps_every_folder_under_the_limit(tmp_path):
    tool = _tool()
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"a-1-py3-none-any.whl": 700, "b-1-py3-none-any.whl": 250, "c-1-py3-none-any.whl": 90, "d-1-py3-none-any.whl": 1}
    wheels = []
    for i, (name, size) in enumerate(sizes.items()):
        w = src / name
        w.write_bytes(bytes([i]) * size)
        wheels.append(w)
    out = tmp_path / "out"
    folder_sizes = tool.pack(wheels, out, limit=300)
    assert all(s <= 300 for s in folder_sizes)
    files = sorted(p for p in out.glob("c*/*") if p.name != "MANIFEST")
    assert sum(p.stat().st_size for p in files) == sum(sizes.values())
    # joining the parts (as gpu-install.sh does) gives the wheel back, and its hash is in MANIFEST
    parts = sorted((p for p in files if p.name.startswith("a-1-py3-none-any.whl.part")), key=lambda p: p.name)
    assert len(parts) == 3
    joined = b"".join(p.read_bytes() for p in parts)
    assert joined == (src / "a-1-py3-none-any.whl").read_bytes()
    manifest = (out / "c1" / "MANIFEST").read_text().split("\n")
    assert sorted(line.split("  ")[1] for line in manifest if line) == sorted(sizes)


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs sha256sum")
def test_installer_joins_parts_checks_hashes_and_refuses_a_corrupt_wheel(tmp_path):
    tool = _tool()
    src = tmp_path / "src"
    src.mkdir()
    w = src / "big-1-py3-none-any.whl"
    w.write_bytes(os.urandom(1000))
    out = tmp_path / "out"
    tool.pack([w], out, limit=300)
    gathered = tmp_path / "w"
    gathered.mkdir()
    for p in out.glob("c*/*"):
        shutil.copyfile(p, gathered / p.name)
    # corrupt one part: the installer must stop before installing anything
    part = gathered / "big-1-py3-none-any.whl.part01"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    env = {**os.environ, "FERRYMAN_SITE": str(tmp_path / "site"), "FERRYMAN_WS": str(tmp_path / "ws")}
    r = subprocess.run(["bash", "-c", f"source {ROOT}/tools/gpu-install.sh {gathered}; echo rc=$?"], env=env, capture_output=True, text=True)
    assert "rc=3" in r.stdout and "missing or corrupt" in r.stdout
    assert not (tmp_path / "site").exists()


def test_download_uses_wheels_already_in_the_cache_and_names_the_build_for_source_only_ones(tmp_path, monkeypatch):
    """A wheel in the cache (one built here from a source-only release, tools/build-te-torch.sh)
    is carried as it is and not asked of the index; a source-only pin without its built wheel
    stops the download with the script that builds it."""
    tool = _tool()
    cache = tmp_path / "cache"
    cache.mkdir()
    pins = [("einops", "0.8.1"), ("transformer-engine-torch", "2.19.0")]
    monkeypatch.setattr(tool, "carried", lambda *a, **k: list(pins))
    asked: list[list[tuple[str, str]]] = []

    def fake_pip(fetch, where):  # stands in for pip download from the index
        asked.append(list(fetch))
        for n, v in fetch:
            if n == "einops":
                (where / f"einops-{v}-py3-none-any.whl").write_bytes(b"x" * 100)

    monkeypatch.setattr(tool, "_pip_download", fake_pip)
    with pytest.raises(SystemExit, match="transformer-engine-torch==2.19.0.*tools/build-te-torch.sh"):
        tool.download("megatron-te", tmp_path / "out", cache)
    assert asked == [pins[:1]]  # the source-only one is never asked of the index
    (cache / "transformer_engine_torch-2.19.0-cp312-cp312-linux_x86_64.whl").write_bytes(b"y" * 200)
    asked.clear()
    tool.download("megatron-te", tmp_path / "out", cache)
    assert asked == []  # both wheels were in the cache: nothing asked of the index
    manifest = (tmp_path / "out" / "c1" / "MANIFEST").read_text()
    assert "einops-0.8.1-py3-none-any.whl" in manifest and "transformer_engine_torch-2.19.0-cp312" in manifest
