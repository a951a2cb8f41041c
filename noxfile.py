"""One session per package (that package and core only, in a clean environment) and one for
the cross-package tests in tests/. GPU tests are marked ``gpu`` and never run here.

    uv run nox -l              # list sessions
    uv run nox -s core         # core alone
    uv run nox -s engine_hf trainer_fsdp integration
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
PY = os.environ.get("UV_PYTHON", "3.12")
TEST_DEPS = ["pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3"]
PACKAGES = {
    "engine_hf": "packages/engine-hf",
    "trainer_fsdp": "packages/trainer-fsdp",
    "router": "packages/router",
    "sync_nccl": "packages/sync-nccl",
    "proxy": "packages/proxy",
    # its CPU tests run over a named fake core: vLLM (the package's `vllm` extra) is not installed
    "engine_vllm": "packages/engine-vllm",
    "engine_sglang": "packages/engine-sglang",
}
EXTRAS = {"proxy": "[test]"}
"""Extras a package's own tests need (installed with it in its session and in integration)."""


@nox.session(python=PY)
def core(session: nox.Session) -> None:
    """Core alone: no plugin installed, no transformers (tests that need it skip)."""
    session.install("./packages/core[testing]", *TEST_DEPS)
    session.run("ferryman", "plugins")
    session.run("pytest", "packages/core/tests", "-q", *session.posargs)


def _plugin_session(name: str, path: str):
    @nox.session(name=name, python=PY)
    def _session(session: nox.Session) -> None:
        session.install("./packages/core[tiny,testing]", f"./{path}{EXTRAS.get(name, '')}", *TEST_DEPS)
        session.run("ferryman", "plugins")
        session.run("pytest", f"{path}/tests", "-q", *session.posargs)

    _session.__doc__ = f"{path} with core only."
    return _session


for _name, _path in PACKAGES.items():
    globals()[_name] = _plugin_session(_name, _path)


@nox.session(name="env_harbor", python=PY)
def env_harbor(session: nox.Session) -> None:
    """packages/env-harbor with what its tests run on: the proxy, the transformers engine and the
    FSDP trainer (the training test). Needs root (Linux namespaces); no Docker."""
    session.env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    session.install(
        "./packages/core[tiny,testing]",
        "./packages/proxy",
        "./packages/engine-hf",
        "./packages/trainer-fsdp",
        "./packages/env-harbor",
        *TEST_DEPS,
    )
    session.run("ferryman", "plugins")
    session.run("pytest", "packages/env-harbor/tests", "-q", *session.posargs)


@nox.session(name="trainer_megatron", python=PY)
def trainer_megatron(session: nox.Session) -> None:
    """packages/trainer-megatron with megatron-core (its `megatron` extra): the CPU tests run the
    real Megatron-core on gloo ranks with its CUDA-only calls patched
    (tests/megatron_cpu_patches.py), and compare it with trainer-fsdp at the same weights."""
    session.install("./packages/core[tiny,testing]", "./packages/trainer-fsdp", "./packages/trainer-megatron[megatron]", *TEST_DEPS)
    session.run("ferryman", "plugins")
    session.run("pytest", "packages/trainer-megatron/tests", "-q", *session.posargs)


@nox.session(python=PY)
def integration(session: nox.Session) -> None:
    """The cross-package tests in tests/ with the whole workspace."""
    session.install("./packages/core[tiny,plot,testing]", *(f"./{p}{EXTRAS.get(n, '')}" for n, p in PACKAGES.items()), *TEST_DEPS)
    session.run("pytest", "tests", "-q", *session.posargs)
