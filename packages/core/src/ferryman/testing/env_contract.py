"""Contract every Env passes. Subclass and provide fixtures ``env`` (an Env) and ``client``
(a GenerateClient the env can call; core's tests use a ServerClient over real engines).

Every assertion says what the plugin did wrong, in the plugin author's terms."""

from __future__ import annotations

import json
import math

from ferryman.protocols import Env
from ferryman.types import SamplingParams, Trajectory


class EnvContract:
    sampling = SamplingParams(max_tokens=8, temperature=1.0)

    async def test_is_an_env(self, env):
        missing = [m for m in ("num_tasks", "get_task", "run") if not callable(getattr(env, m, None))]
        assert not missing, f"{type(env).__name__} lacks the Env methods {missing} (see ferryman.protocols.Env)"
        assert isinstance(env, Env), f"{type(env).__name__} does not satisfy ferryman.protocols.Env"

    async def test_has_json_tasks(self, env):
        num = env.num_tasks()
        assert isinstance(num, int) and not isinstance(num, bool), f"num_tasks() returned {num!r}, not an int"
        assert num >= 1, f"num_tasks() returned {num}: a run needs at least one task"
        task = env.get_task(0)
        try:
            json.dumps(task, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise AssertionError(
                f"get_task(0) returned {task!r}, which is not JSON ({e}): tasks go into checkpoints and traces"
            ) from None

    @staticmethod
    def segments(result):
        """``env.run`` returns a Trajectory or a non-empty list of segments."""
        trajs = list(result) if isinstance(result, (list, tuple)) else [result]
        assert trajs, "env.run returned an empty list of segments (return a Trajectory, or a non-empty list of them)"
        for t in trajs:
            assert isinstance(t, Trajectory), f"env.run returned {type(t).__name__}, not a ferryman.types.Trajectory"
        return trajs

    async def test_run_returns_scored_consistent_trajectory(self, env, client):
        trajs = self.segments(await env.run(env.get_task(0), "contract-req-1", client, self.sampling))
        for k, traj in enumerate(trajs):
            where = f"segment {k} of run 'contract-req-1'"
            try:
                traj.validate()
            except ValueError as e:
                raise AssertionError(f"{where} is inconsistent: {e} (append with append_model_tokens / append_observation)") from None
            assert traj.request_id == "contract-req-1", f"{where} has request_id {traj.request_id!r}: use the request id run() was given"
            assert traj.reward is not None, f"{where} has no reward: set traj.reward (a finite float) before returning"
            assert isinstance(traj.reward, float), f"{where} has reward {traj.reward!r} of type {type(traj.reward).__name__}: use a float"
            assert math.isfinite(traj.reward), f"{where} has reward {traj.reward}: rewards must be finite (NaN or inf would poison the whole group's advantages)"
            for i, (m, v, lp) in enumerate(zip(traj.response_mask, traj.token_versions, traj.rollout_log_probs)):
                assert m in (0, 1), f"{where}: response_mask[{i}] is {m!r}; use 1 for model tokens, 0 for observations"
                assert math.isfinite(lp), f"{where}: rollout_log_probs[{i}] is {lp}, not finite"
                if m:
                    assert v >= 0 and lp <= 0.0, (
                        f"{where}: model token {i} has version {v} and log-prob {lp}; model tokens carry the engine's "
                        "version (>= 0) and log-prob (<= 0): append them with append_model_tokens(out)"
                    )
                else:
                    assert v == -1 and lp == 0.0, (
                        f"{where}: observation token {i} has version {v} and log-prob {lp}; tokens the policy did not "
                        "produce have version -1 and log-prob 0.0: append them with append_observation(ids)"
                    )
        rewards = {t.reward for t in trajs}
        assert len(rewards) == 1, f"the segments of one run carry different rewards {sorted(rewards)}: give each the run's reward"
        assert sum(sum(t.response_mask) for t in trajs) >= 1, "the run has no model token (mask 1): the policy must have produced at least one token"

    async def test_runs_are_independent(self, env, client):
        a = self.segments(await env.run(env.get_task(0), "contract-req-a", client, self.sampling))[0]
        b = self.segments(await env.run(env.get_task(0), "contract-req-b", client, self.sampling))[0]
        assert a.prompt_ids == b.prompt_ids, "two runs of the same task started from different prompts: a task's prompt must not depend on earlier runs"
        assert a.request_id != b.request_id, f"two runs both returned request_id {a.request_id!r}: use the request id run() was given"
