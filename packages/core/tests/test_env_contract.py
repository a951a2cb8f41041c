"""EnvContract itself: a sound env passes it; an env that is wrong in a common way fails it with
a message saying what the plugin did wrong."""

from __future__ import annotations

import pytest

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.testing import EnvContract
from ferryman.testing.doubles import EchoEngine

from helpers import EchoEnv


@pytest.fixture
def client():
    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    return ServerClient(LocalRouter(["r0"]), engines, partial_rollout=False)


class TestEchoEnvContract(EnvContract):
    @pytest.fixture
    def env(self):
        return EchoEnv(turns=2)


class Wrong(EchoEnv):
    def __init__(self, how: str) -> None:
        super().__init__(num_tasks=0 if how == "no_tasks" else 3)
        self.how = how

    def get_task(self, index):
        task = super().get_task(index)
        if self.how == "set_task":
            task["tags"] = {"a"}
        return task

    async def run(self, task, request_id, client, params):
        traj = await super().run(task, request_id, client, params)
        if self.how == "nan_reward":
            traj.reward = float("nan")
        elif self.how == "int_reward":
            traj.reward = 1
        elif self.how == "no_reward":
            traj.reward = None
        elif self.how == "observation_as_model":
            traj.response_ids.append(9)
            traj.response_mask.append(0)
            traj.rollout_log_probs.append(-0.5)
            traj.token_versions.append(0)
        elif self.how == "short_mask":
            traj.response_mask.pop()
        elif self.how == "wrong_request_id":
            traj.request_id = "mine"
        return traj


@pytest.mark.parametrize(
    "how,test,needle",
    [
        ("no_tasks", "test_has_json_tasks", "num_tasks() returned 0: a run needs at least one task"),
        ("set_task", "test_has_json_tasks", "which is not JSON (Object of type set is not JSON serializable)"),
        ("nan_reward", "test_run_returns_scored_consistent_trajectory", "has reward nan: rewards must be finite"),
        ("int_reward", "test_run_returns_scored_consistent_trajectory", "has reward 1 of type int: use a float"),
        ("no_reward", "test_run_returns_scored_consistent_trajectory", "has no reward: set traj.reward"),
        ("observation_as_model", "test_run_returns_scored_consistent_trajectory", "append them with append_observation(ids)"),
        ("short_mask", "test_run_returns_scored_consistent_trajectory", "is inconsistent: Trajectory contract-req-1: response_mask has"),
        ("wrong_request_id", "test_run_returns_scored_consistent_trajectory", "use the request id run() was given"),
    ],
)
async def test_a_wrong_env_fails_the_contract_saying_what_is_wrong(client, how, test, needle):
    env = Wrong(how)
    method = getattr(EnvContract(), test)
    args = (env, client) if "client" in method.__code__.co_varnames[: method.__code__.co_argcount] else (env,)
    with pytest.raises(AssertionError) as err:
        await method(*args)
    assert needle in str(err.value)
