"""Registration through the ``ferryman`` hooks and the entry point; the receiver factory."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

import ferryman_sync_nccl
from ferryman.plugins import PluginHost
from ferryman_sync_nccl import NcclSyncConfig, hooks
from ferryman_sync_nccl.testing import CONFIG_DEFAULTS


def _installed() -> bool:
    try:
        md.distribution("ferryman-sync-nccl")
    except md.PackageNotFoundError:
        return False
    return True


def test_registers_nccl_with_a_receiver_factory():
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    spec = host.specs("weight_sync")["nccl"]
    assert spec.config_cls is NcclSyncConfig and spec.factory is hooks.make_transport
    assert spec.receiver_factory is hooks.make_receiver and spec.description
    assert "object_store" in host.specs("weight_sync"), "core's default stays"


@pytest.mark.skipif(not _installed(), reason="ferryman-sync-nccl is not installed in this environment (entry points need it)")
def test_entry_point_is_found_and_versioned():
    (ep,) = [e for e in md.entry_points(group="ferryman") if e.value == "ferryman_sync_nccl.hooks"]
    assert ep.name == "sync_nccl" and ep.dist is not None and ep.dist.version == ferryman_sync_nccl.__version__
    host = PluginHost()
    assert host.owner("weight_sync", "nccl").distribution == "ferryman-sync-nccl"


def test_hooks_module_imports_nothing_heavy():
    code = (
        "import sys; import ferryman_sync_nccl.hooks; "
        "heavy = [m for m in ('ray', 'torch', 'zmq') if m in sys.modules]; print(','.join(heavy))"
    )
    src = str(Path(ferryman_sync_nccl.__file__).parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": src})
    assert out.stdout.strip() == "", f"hooks imported {out.stdout.strip()}"


def test_the_torch_only_fallback_config_matches_the_real_defaults():
    assert NcclSyncConfig().model_dump() == CONFIG_DEFAULTS


def test_source_device_says_where_the_buffers_are(monkeypatch):
    """The Synchronizer asks the trainer for GPU tensors only when the transport's buffers are
    on the GPU (``source_device``); on this CPU machine every transport's are in host memory,
    and asking for the GPU explicitly where none is visible still says ``cpu``."""
    import torch

    from ferryman_sync_nccl import IpcSync, IpcSyncConfig, NcclSync

    assert NcclSync(NcclSyncConfig(backend="gloo")).source_device == "cpu"
    assert IpcSync(IpcSyncConfig(device="cpu")).source_device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert NcclSync(NcclSyncConfig(backend="auto")).source_device == "cpu"
    assert NcclSync(NcclSyncConfig(backend="nccl")).source_device == "cpu"  # refused later, at connect
    assert IpcSync(IpcSyncConfig(device="auto")).source_device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert NcclSync(NcclSyncConfig(backend="nccl")).source_device == "cuda"
    assert IpcSync(IpcSyncConfig(device="auto")).source_device == "cuda"
