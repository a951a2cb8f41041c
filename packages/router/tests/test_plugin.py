"""Registration through the ``ferryman`` hooks and the entry point."""

from __future__ import annotations

import importlib.metadata as md

import pytest

import ferryman_router
from ferryman.plugins import PluginHost
from ferryman_router import StickyRouterConfig, hooks, make_router


def _installed() -> bool:
    try:
        md.distribution("ferryman-router")
    except md.PackageNotFoundError:
        return False
    return True


def test_registers_sticky_next_to_cores_local():
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    specs = host.specs("router")
    assert {"local", "sticky"} <= set(specs)
    spec = specs["sticky"]
    assert spec.config_cls is StickyRouterConfig and spec.factory is make_router and spec.description


@pytest.mark.skipif(not _installed(), reason="ferryman-router is not installed in this environment (entry points need it)")
def test_entry_point_is_found_and_versioned():
    (ep,) = [e for e in md.entry_points(group="ferryman") if e.value == "ferryman_router.hooks"]
    assert ep.name == "router" and ep.dist is not None and ep.dist.version == ferryman_router.__version__
    host = PluginHost()
    assert "sticky" in host.specs("router")
    assert host.owner("router", "sticky").distribution == "ferryman-router"


def test_hooks_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = (
        "import sys; import ferryman_router.hooks; "
        "heavy = [m for m in ('ray', 'torch') if m in sys.modules]; print(','.join(heavy))"
    )
    src = str(__import__("pathlib").Path(ferryman_router.__file__).parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": src})
    assert out.stdout.strip() == "", f"hooks imported {out.stdout.strip()}"
