"""Meta-tests: every hook is documented (parameters/returns, an example, versionadded) and
has a test that names it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ferryman import hookspecs

HOOKS = [name for name in dir(hookspecs) if name.startswith("ferryman_")]
TESTS = Path(__file__).parent


def test_hook_lists_are_complete():
    assert set(HOOKS) == set(hookspecs.REGISTRATION_HOOKS.values()) | set(hookspecs.OBSERVER_HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    assert len(doc.splitlines()[0]) > 10, f"{name}: needs a summary line"
    assert "Example::" in doc, f"{name}: needs an example"
    assert "versionadded" in doc, f"{name}: needs versionadded"
    assert "ferryman.hookimpl" in doc, f"{name}: the example must show the hookimpl"
    assert all(p in inspect.signature(fn).parameters for p in inspect.signature(fn).parameters)
    assert fn.__annotations__.get("return") is not None, f"{name}: return type annotated"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name):
    text = "\n".join(p.read_text() for p in TESTS.glob("test_*.py") if p.name != "test_meta.py")
    assert name in text, f"no test in {TESTS} names {name}"


def test_writing_a_plugin_doc_exists():
    root = Path(__file__).resolve().parents[3]
    doc = root / "docs" / "writing-a-plugin.md"
    if not doc.exists():
        pytest.skip("docs are not shipped with this install")
    text = doc.read_text()
    for word in ("entry-points.ferryman", "EnvContract", "hookimpl"):
        assert word in text
