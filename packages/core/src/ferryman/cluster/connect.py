"""Start a local Ray for the run, or join an existing cluster."""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

from ferryman.config import ConfigError

log = logging.getLogger(__name__)


def resolve_address(configured: str | None) -> str | None:
    """The cluster to join: ``ray.address`` if set, else ``$RAY_ADDRESS`` (set by
    ``ray job submit`` and on KubeRay pods), else ``None`` (start a local Ray)."""
    if configured is not None:
        return configured.strip()
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return env or None


def job_env_vars(env_vars: dict[str, str]) -> dict[str, str]:
    """``env_vars`` less the variables the submitted job's own runtime env sets (under ``ray job
    submit --runtime-env-json``): Ray refuses a driver runtime env that names them again, and
    the job's values win."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return dict(env_vars)
    try:
        job_vars = (json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}
    except (ValueError, AttributeError):
        return dict(env_vars)
    return {k: v for k, v in env_vars.items() if k not in job_vars}


def _probe(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a cluster address nothing answers at: ``ray.init`` would retry for minutes."""
    if address == "auto":
        return  # Ray resolves it from $RAY_ADDRESS or this machine's running cluster, or says it found none
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray.address: {address!r} is not 'auto', 'HOST:PORT' or 'ray://HOST:PORT'")
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"ray.address: nothing answers at {address!r} ({e.__class__.__name__}: {e}); is the Ray head running?") from None


def connect(
    address: str | None,
    *,
    num_cpus: int | None,
    namespace: str | None,
    num_gpus: int | None = None,
    env_vars: dict[str, str],
    logging_level: int = logging.WARNING,
) -> bool:
    """Connect this driver to Ray: start a local one (``address=None``) or join a cluster.
    Returns True if this call connected (the caller calls ``ray.shutdown()``: that stops a
    local Ray and only disconnects from a cluster), False if Ray was already up. Joining passes no resource arguments (Ray refuses them for an existing cluster);
    ``env_vars`` reach every worker through the job's runtime env either way."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env: dict[str, Any] = {"env_vars": job_env_vars(env_vars)}
    if address is None:
        gpus = {} if num_gpus is None else {"num_gpus": num_gpus}
        ray.init(
            num_cpus=num_cpus, **gpus, include_dashboard=False, logging_level=logging_level, namespace=namespace, runtime_env=runtime_env
        )
        return True
    _probe(address)
    try:
        ray.init(address=address, logging_level=logging_level, namespace=namespace, runtime_env=runtime_env)
    except ConnectionError as e:
        raise ConfigError(f"ray.address: cannot join the Ray cluster at {address!r} ({e})") from None
    except Exception as e:
        if "connect" in str(e).lower() or "could not find any running ray instance" in str(e).lower():
            raise ConfigError(f"ray.address: cannot join the Ray cluster at {address!r} ({e.__class__.__name__}: {e})") from None
        raise
    ctx = ray.get_runtime_context()
    log.info("joined the Ray cluster at %s (node %s)", address, ctx.get_node_id())
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface, for peers on other nodes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def no_uv_run_workers() -> None:
    """Under ``uv run``, Ray would start every worker through ``uv run`` as well (re-resolving the
    project, possibly trying to download an interpreter: fatal offline). The driver's own
    interpreter and environment are the right ones for the workers. Ray reads the switch
    ``RAY_ENABLE_UV_RUN_RUNTIME_ENV`` once, when first imported, so set the constant too."""
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    except (ImportError, AttributeError):  # pragma: no cover - other Ray versions
        pass
