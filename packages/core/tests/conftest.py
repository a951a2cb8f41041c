import sys
import types
from pathlib import Path
from typing import Literal

import pytest

import ferryman
from ferryman.config import PluginConfig
from ferryman.plugins import PluginHost
from ferryman.specs import EngineSpec, TrainerSpec

sys.path.insert(0, str(Path(__file__).parent))


class EchoEngineConfig(PluginConfig):
    type: Literal["echo"] = "echo"
    step_delay_s: float = 0.0


def _make_echo(config, **_):
    from ferryman.testing.doubles import EchoEngine

    return EchoEngine(step_delay_s=config.step_delay_s)


def _no_trainer(config, **_):
    raise NotImplementedError("core's tests register a trainer name for config validation only")


test_doubles = types.ModuleType("core_test_doubles")


@ferryman.hookimpl
def ferryman_register_engines():
    return [EngineSpec("echo", _make_echo, EchoEngineConfig, "test double: formula engine, no model")]


@ferryman.hookimpl
def ferryman_register_trainers():
    return [TrainerSpec("echo", _no_trainer, EchoEngineConfig.__base__, "test double: config only")]


test_doubles.ferryman_register_engines = ferryman_register_engines
test_doubles.ferryman_register_trainers = ferryman_register_trainers

# core's tests pick these in place of the hf engine and fsdp trainer (plugins, not installed here)
BASE = ["engine={type: echo}", "trainer={type: echo}"]


@pytest.fixture
def host() -> PluginHost:
    """Core's defaults plus the test doubles above; never the installed plugins, so core's tests
    do not silently depend on them."""
    return PluginHost(load_entry_points=False, extra_plugins=(test_doubles,))
