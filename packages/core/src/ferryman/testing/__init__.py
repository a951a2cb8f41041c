"""Contract suites for every role. An implementation's ``tests/test_contract.py`` subclasses the
suite of its role and supplies the fixtures the suite's docstring names::

    from ferryman.testing import EnvContract

    class TestMyEnv(EnvContract):
        @pytest.fixture
        def env(self): ...
        @pytest.fixture
        def client(self): ...

Overriding or removing a contract test needs an explicit ``pytest.mark.xfail(reason=...)``.
"""

from ferryman.testing.env_contract import EnvContract
from ferryman.testing.queue_contract import QueueContract
from ferryman.testing.router_contract import RouterContract
from ferryman.testing.weight_sync_contract import WeightSyncContract

__all__ = ["EngineContract", "EnvContract", "QueueContract", "RouterContract", "TrainerContract", "WeightSyncContract"]


def __getattr__(name: str):
    # the engine and trainer suites import torch-heavy helpers; load them on first use
    if name == "EngineContract":
        from ferryman.testing.engine_contract import EngineContract

        return EngineContract
    if name == "TrainerContract":
        from ferryman.testing.trainer_contract import TrainerContract

        return TrainerContract
    raise AttributeError(name)
