"""Every hook ferryman calls, in one module.

Two kinds of hook:

* **Registration hooks** (``ferryman_register_*``) return a list of frozen records from
  :mod:`ferryman.specs`. A run's config picks one record per role by its ``type`` field. Two
  records with the same name in one role are an error naming both distributions.
* **Observer hooks** (``ferryman_on_*``) are called for lifecycle events. Their return values
  are ignored and an exception in one is logged and swallowed, so an observer can never stop a
  run. Trackers and user code use them.

Implement a hook with :data:`ferryman.hookimpl` in a module named by an entry point in the
``ferryman`` group::

    # pyproject.toml
    [project.entry-points.ferryman]
    my_env = "my_env_pkg.hooks"

    # my_env_pkg/hooks.py
    import ferryman
    from ferryman.specs import EnvSpec

    @ferryman.hookimpl
    def ferryman_register_envs():
        from my_env_pkg.env import MyEnv, MyEnvConfig   # import heavy things lazily
        return [EnvSpec("my_env", MyEnv.from_config, MyEnvConfig)]
"""

from __future__ import annotations

from typing import Any

import pluggy

from ferryman.specs import (
    EngineSpec,
    EnvSpec,
    QueueSpec,
    RouterSpec,
    TrackerSpec,
    TrainerSpec,
    WeightSyncSpec,
)

PROJECT = "ferryman"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# ----------------------------------------------------------------------------- registration


@hookspec
def ferryman_register_engines() -> list[EngineSpec]:
    """Register rollout engines.

    :returns: a list of :class:`ferryman.specs.EngineSpec`; each factory builds an object
        satisfying :class:`ferryman.protocols.Engine` from its config and the keywords
        ``model_path``, ``replica``, ``seed``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_engines():
            return [EngineSpec("hf", make_hf_engine, HFEngineConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_queues() -> list[QueueSpec]:
    """Register sample queues between the Rollouter and the Trainer.

    :returns: a list of :class:`ferryman.specs.QueueSpec`; each factory builds a
        :class:`ferryman.protocols.Queue` from its config and ``maxsize``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_queues():
            return [QueueSpec("ray", make_queue, RayQueueConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_routers() -> list[RouterSpec]:
    """Register routers that pick an engine replica per request id.

    :returns: a list of :class:`ferryman.specs.RouterSpec`; each factory builds a
        :class:`ferryman.protocols.Router` from its config, ``replicas`` and ``seed``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_routers():
            return [RouterSpec("local", LocalRouter.from_config, LocalRouterConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_weight_syncs() -> list[WeightSyncSpec]:
    """Register weight transports from the trainer to the engines.

    :returns: a list of :class:`ferryman.specs.WeightSyncSpec`; each factory builds a
        :class:`ferryman.protocols.WeightSync` from its config.

    Example::

        @ferryman.hookimpl
        def ferryman_register_weight_syncs():
            return [WeightSyncSpec("nccl", make_nccl_sync, NcclSyncConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_envs() -> list[EnvSpec]:
    """Register agent environments (white-box loops or black-box agents behind the proxy).

    :returns: a list of :class:`ferryman.specs.EnvSpec`; each factory builds a
        :class:`ferryman.protocols.Env` from its config, ``tokenizer`` and ``seed``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_envs():
            return [EnvSpec("digits", DigitsEnv.from_config, DigitsEnvConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_trainers() -> list[TrainerSpec]:
    """Register training backends.

    :returns: a list of :class:`ferryman.specs.TrainerSpec`; each factory builds a
        :class:`ferryman.protocols.TrainerBackend` from its config and ``model_path``,
        ``algorithm``, ``seed``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_trainers():
            return [TrainerSpec("fsdp", make_fsdp_trainer, FSDPTrainerConfig)]

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_register_trackers() -> list[TrackerSpec]:
    """Register metric sinks.

    :returns: a list of :class:`ferryman.specs.TrackerSpec`; each factory builds a
        :class:`ferryman.protocols.Tracker` from its config and ``run_dir``.

    Example::

        @ferryman.hookimpl
        def ferryman_register_trackers():
            return [TrackerSpec("jsonl", JsonlTracker.from_config, JsonlTrackerConfig)]

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------- observers


@hookspec
def ferryman_on_run_start(config: Any, run_dir: str) -> None:
    """Called once in the driver after the config is validated, before any actor starts.

    :param config: the :class:`ferryman.config.RunConfig`.
    :param run_dir: the run directory (exists).

    Example::

        @ferryman.hookimpl
        def ferryman_on_run_start(config, run_dir):
            print("starting", run_dir)

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_on_sample_produced(sample: Any) -> None:
    """Called in the Rollouter for each finished :class:`ferryman.types.Sample`, just before it
    is put on the queue.

    Example::

        @ferryman.hookimpl
        def ferryman_on_sample_produced(sample):
            print(sample.uid, [t.reward for t in sample.trajectories])

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_on_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called in the Trainer after each local step with that step's metrics.

    Example::

        @ferryman.hookimpl
        def ferryman_on_step_end(step, metrics):
            print(step, metrics["reward/mean"])

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_on_weights_synced(version: int, metrics: dict[str, float]) -> None:
    """Called in the Trainer after every engine runs the new weight ``version``.

    Example::

        @ferryman.hookimpl
        def ferryman_on_weights_synced(version, metrics):
            print("now at version", version, metrics["sync/total_s"])

    .. versionadded:: 0.1
    """


@hookspec
def ferryman_on_run_end(run_dir: str, metrics: dict[str, float]) -> None:
    """Called once in the driver when the run ends (normally or not).

    Example::

        @ferryman.hookimpl
        def ferryman_on_run_end(run_dir, metrics):
            print("done", metrics)

    .. versionadded:: 0.1
    """


REGISTRATION_HOOKS: dict[str, str] = {
    "engine": "ferryman_register_engines",
    "queue": "ferryman_register_queues",
    "router": "ferryman_register_routers",
    "weight_sync": "ferryman_register_weight_syncs",
    "env": "ferryman_register_envs",
    "trainer": "ferryman_register_trainers",
    "tracker": "ferryman_register_trackers",
}
OBSERVER_HOOKS = (
    "ferryman_on_run_start",
    "ferryman_on_sample_produced",
    "ferryman_on_step_end",
    "ferryman_on_weights_synced",
    "ferryman_on_run_end",
)
