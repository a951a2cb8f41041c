"""A plugin module for the pre-start check tests, registered with ``FERRYMAN_PLUGINS`` (as a user
would a module that is not installed): envs that are wrong in the ways newcomers get them wrong,
and the echo engine and a config-only trainer so that a config validates without other plugins."""

from __future__ import annotations

from typing import Literal

import ferryman
from ferryman.config import PluginConfig
from ferryman.specs import EngineSpec, EnvSpec, TrainerSpec


class ListEnvConfig(PluginConfig):
    type: Literal["list_env"] = "list_env"
    num_tasks: int = 3
    """How many tasks (0: none, which a run cannot use)."""
    task_kind: Literal["json", "set"] = "json"


class ListEnv:
    def __init__(self, config: ListEnvConfig) -> None:
        self.config = config

    @classmethod
    def from_config(cls, config: ListEnvConfig, **_):
        return cls(config)

    def num_tasks(self) -> int:
        return self.config.num_tasks

    def get_task(self, index: int):
        return {"index": index} if self.config.task_kind == "json" else {"index": {index}}

    async def run(self, task, request_id, client, params):  # pragma: no cover - never run here
        raise RuntimeError("not run in these tests")


class EchoConfig(PluginConfig):
    type: Literal["echo"] = "echo"
    step_delay_s: float = 0.0


def _echo(config, **_):
    from ferryman.testing.doubles import EchoEngine

    return EchoEngine(step_delay_s=config.step_delay_s)


def _no_trainer(config, **_):  # pragma: no cover
    raise NotImplementedError("config validation only")


@ferryman.hookimpl
def ferryman_register_envs():
    return [EnvSpec("list_env", ListEnv.from_config, ListEnvConfig, "test: a list of tasks")]


@ferryman.hookimpl
def ferryman_register_engines():
    return [EngineSpec("echo", _echo, EchoConfig, "test double: formula engine, no model")]


@ferryman.hookimpl
def ferryman_register_trainers():
    return [TrainerSpec("echo", _no_trainer, PluginConfig, "test double: config only")]
