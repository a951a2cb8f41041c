"""Registration records returned by the ``ferryman_register_*`` hooks.

Each record names an implementation, gives its factory and its pydantic config class (a
subclass of :class:`ferryman.config.PluginConfig`). The config's ``type`` field selects the
record by ``name``. Factories take the validated config plus keyword-only context and must
accept (and ignore) unknown keywords, so that core can pass more context later.

Factory keywords by role:

- engine: ``model_path: str``, ``replica: str``, ``seed: int``
- trainer: ``model_path: str``, ``algorithm: AlgorithmConfig``, ``seed: int``
- env: ``tokenizer`` (a transformers tokenizer), ``seed: int``
- router: ``replicas: list[str]``, ``seed: int``
- queue: ``maxsize: int``, ``trace_to: (run_dir, level)`` (a queue in another process traces there)
- weight_sync: (none). A transport whose engine side needs its own code (a process-group
  member, a socket) also gives ``receiver_factory(params, *, engine, replica, loop)``: the
  engine host calls it where the replica lives (see
  :meth:`ferryman.engine_host.EngineHandle.attach_weight_receiver`).
- tracker: ``run_dir: str``, ``resume_step: int | None`` (the run resumed from the checkpoint of that step)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferryman.config import PluginConfig


@dataclass(frozen=True)
class _Spec:
    name: str
    factory: Callable[..., Any]
    config_cls: type[PluginConfig]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{type(self).__name__}: invalid name {self.name!r}")
        if not (isinstance(self.config_cls, type) and issubclass(self.config_cls, PluginConfig)):
            raise TypeError(
                f"{type(self).__name__}({self.name!r}): config_cls must subclass "
                "ferryman.config.PluginConfig"
            )


@dataclass(frozen=True)
class EngineSpec(_Spec):
    """A rollout engine (see :class:`ferryman.protocols.Engine`)."""


@dataclass(frozen=True)
class QueueSpec(_Spec):
    """A sample queue (see :class:`ferryman.protocols.Queue`)."""


@dataclass(frozen=True)
class RouterSpec(_Spec):
    """A replica router (see :class:`ferryman.protocols.Router`)."""


@dataclass(frozen=True)
class WeightSyncSpec(_Spec):
    """A weight transport (see :class:`ferryman.protocols.WeightSync`)."""

    receiver_factory: Callable[..., Any] | None = None
    """Optional engine-side half of the transport: ``receiver_factory(params, *, engine,
    replica, loop)`` builds a receiver beside one engine replica (inside its Ray actor, or in
    this process for local engines) from the JSON-able ``params`` the transport sent; the
    receiver loads what it receives with ``engine.load_weights`` on ``loop``. It may have a
    ``close()`` method, called when it is replaced or the engine shuts down."""


@dataclass(frozen=True)
class EnvSpec(_Spec):
    """An agent environment (see :class:`ferryman.protocols.Env`)."""


@dataclass(frozen=True)
class TrainerSpec(_Spec):
    """A trainer backend (see :class:`ferryman.protocols.TrainerBackend`)."""

    exporter: Callable[..., Any] | None = None
    """Optional: ``exporter(checkpoint_dir, *, model_path, config, out_dir, dtype)`` writes the
    actor of a checkpoint this backend saved (``save_checkpoint``, the ``trainer/`` folder of a
    run checkpoint) as Hugging Face model files in ``out_dir``: safetensors weights,
    ``config.json``, ``generation_config.json``; ``model_path`` is the run's base model and
    ``config`` the backend's validated config. ``ferryman export`` adds the tokenizer."""


@dataclass(frozen=True)
class TrackerSpec(_Spec):
    """A metric sink (see :class:`ferryman.protocols.Tracker`)."""


ROLES: dict[str, type[_Spec]] = {
    "engine": EngineSpec,
    "queue": QueueSpec,
    "router": RouterSpec,
    "weight_sync": WeightSyncSpec,
    "env": EnvSpec,
    "trainer": TrainerSpec,
    "tracker": TrackerSpec,
}
