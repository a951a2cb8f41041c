"""Validation and evaluation on held-out tasks.

:func:`evaluate` runs every task of an env ``n`` times through a generate client (the run's own
server client and engines during training, or fresh engines for ``ferryman eval``) and reports
pass@1, pass@n, the mean reward and the mean response length. Nothing it produces is queued or
trained on, and it never touches the Rollouter's admission or staleness quota.

During training (``validation.every_steps``) the Trainer starts a validation right after the
weight sync of that step and awaits it before the next sync, so every validation token comes
from one weight version: the one it is tagged with (``val/weight_version``; ``val/min_version``
and ``val/max_version`` say which versions the tokens actually carry). In colocated mode it is
awaited at once (the engines sleep while the Trainer trains). Each validation is a
``validation.run`` span in the trace: its own lane in ``ferryman timeline``.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ferryman import trace
from ferryman.protocols import Env, GenerateClient
from ferryman.types import SamplingParams, new_id

__all__ = ["EvalResult", "TaskSubset", "Validator", "evaluate", "pass_at_k", "split_env"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one task with ``c`` passing answers out of ``n``
    (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class TaskSubset:
    """An env that shows only some of another env's tasks (a held-out split)."""

    def __init__(self, env: Env, indices: list[int]) -> None:
        if not indices:
            raise ValueError("TaskSubset: no tasks")
        self.env = env
        self.indices = list(indices)
        self.resumable = bool(getattr(env, "resumable", False))

    def num_tasks(self) -> int:
        return len(self.indices)

    def get_task(self, index: int) -> dict[str, Any]:
        return self.env.get_task(self.indices[index])

    async def run(self, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams) -> Any:
        return await self.env.run(task, request_id, client, params)

    def stats(self) -> dict[str, float]:
        stats = getattr(self.env, "stats", None)
        return stats() if callable(stats) else {}

    async def aclose(self) -> None:
        close = getattr(self.env, "aclose", None)
        if close is not None:
            await close()


def split_env(env: Env, share: float) -> tuple[TaskSubset, TaskSubset]:
    """``(train, held_out)``: the last ``ceil(share × tasks)`` tasks are held out."""
    num = env.num_tasks()
    held = max(1, math.ceil(share * num))
    if held >= num:
        raise ValueError(f"validation.split: {share} of {num} tasks leaves none to train on")
    return TaskSubset(env, list(range(num - held))), TaskSubset(env, list(range(num - held, num)))


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """``pass@1``, ``pass@n``, ``reward_mean``, ``response_length_mean``, versions, counts."""
    tasks: list[dict[str, Any]] = field(default_factory=list)
    """Per task: its index, rewards and passes of its ``n`` runs."""

    def prefixed(self, prefix: str = "val/") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in self.metrics.items()}


async def evaluate(
    env: Env,
    client: GenerateClient,
    *,
    n: int,
    sampling: SamplingParams,
    num_tasks: int | None = None,
    success_threshold: float = 1.0,
    concurrency: int = 64,
    request_prefix: str = "val",
) -> EvalResult:
    """Run each of the env's first ``num_tasks`` tasks (all by default) ``n`` times. A run that
    raises counts as failed (not passed, no reward). A run's response length is the number of
    model tokens over all its segments."""
    if n < 1:
        raise ValueError(f"evaluate: n must be >= 1, got {n}")
    total = env.num_tasks() if num_tasks is None else min(num_tasks, env.num_tasks())
    gate = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()

    async def one(index: int, task: dict[str, Any], j: int) -> dict[str, Any] | None:
        async with gate:
            try:
                result = await env.run(task, new_id(f"{request_prefix}-{index}-{j}-"), client, sampling)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed run is counted, as in training
                return {"error": repr(e)}
        trajs = list(result) if isinstance(result, (list, tuple)) else [result]
        versions = [v for t in trajs for v, m in zip(t.token_versions, t.response_mask) if m]
        reward = trajs[0].reward if trajs else None
        return {
            "reward": None if reward is None else float(reward),
            "tokens": len(versions),
            "min_version": min(versions, default=-1),
            "max_version": max(versions, default=-1),
        }

    tasks = [env.get_task(i) for i in range(total)]
    runs = await asyncio.gather(*(one(i, tasks[i], j) for i in range(total) for j in range(n)))
    per_task: list[dict[str, Any]] = []
    rewards: list[float] = []
    lengths: list[int] = []
    versions: list[int] = []
    failed = 0
    p1 = pn = 0.0
    for i in range(total):
        mine = runs[i * n : (i + 1) * n]
        task_rewards = [r.get("reward") for r in mine]
        passed = [r is not None and r >= success_threshold for r in task_rewards]
        for r in mine:
            if r.get("reward") is None:
                failed += 1
                continue
            rewards.append(r["reward"])
            lengths.append(r["tokens"])
            if r["min_version"] >= 0:
                versions += [r["min_version"], r["max_version"]]
        c = sum(passed)
        p1 += c / n
        pn += pass_at_k(n, c, n)
        per_task.append({"index": i, "rewards": task_rewards, "passed": c})
    metrics = {
        "pass@1": p1 / max(total, 1),
        f"pass@{n}": pn / max(total, 1),
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "num_tasks": float(total),
        "num_runs": float(total * n),
        "failed_runs": float(failed),
        "min_version": float(min(versions, default=-1)),
        "max_version": float(max(versions, default=-1)),
        "time_s": time.monotonic() - t0,
    }
    return EvalResult(metrics, per_task)


class Validator:
    """Validation during training: :func:`evaluate` on the held-out env through the run's client,
    tagged with the weight version and traced as a ``validation.run`` span."""

    def __init__(self, env: Env, client: GenerateClient, *, n: int, sampling: SamplingParams, num_tasks: int | None,
                 success_threshold: float, concurrency: int) -> None:
        self.env = env
        self.client = client
        self.n = n
        self.sampling = sampling
        self.num_tasks = num_tasks
        self.success_threshold = success_threshold
        self.concurrency = concurrency
        self.history: list[dict[str, float]] = []

    async def run(self, step: int, version: int) -> dict[str, float]:
        t0 = time.time()
        result = await evaluate(
            self.env, self.client, n=self.n, sampling=self.sampling, num_tasks=self.num_tasks,
            success_threshold=self.success_threshold, concurrency=self.concurrency, request_prefix=f"val{step}",
        )
        m = result.prefixed()
        m["val/weight_version"] = float(version)
        m["val/step"] = float(step)
        trace.complete("validation.run", t0, time.time() - t0, step=step, version=version,
                       pass_at_1=m["val/pass@1"], runs=int(m["val/num_runs"]))
        self.history.append(m)
        return m
