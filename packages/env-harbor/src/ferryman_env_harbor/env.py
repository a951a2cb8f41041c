"""``HarborEnv``: one Harbor Trial is one rollout (seed §08).

``run()`` opens a proxy session, builds a ``TrialConfig`` (the task, the agent pointed at the
session's URL with a LiteLLM model name, the environment and verifier sections passed through
unchanged), runs the Trial, and returns the session's trajectory segments, each carrying the
verifier's reward and the four phase timings. Harbor records failures in its result rather than
raising; the result's error policy decides what training does with the run:

* graded with a valid reward (no error, or an error Harbor still grades with a valid reward
  such as an agent timeout) → the segments are returned with that reward;
* not graded, or no valid reward (the sandbox build failed, a setup timeout, an LLM API error,
  the verifier failed or wrote no reward, the reward key is missing, the trial exceeded
  ``trial_timeout_sec``, ``Trial.create`` refused the task) → retried while Harbor's policy says
  so and ``retries`` allow, then dropped (``HarborTrialInvalid`` is raised, which the Rollouter
  counts as a failed trajectory) or masked (``on_invalid: mask``);
* an agent that made no LLM call through the proxy (oracle, nop) has no tokens to train on:
  ``HarborNoTokens`` is raised. :meth:`HarborEnv.run_trial` gives such runs' outcome to callers
  that want the reward alone.

Cancellation (a shutdown; a weight sync never cancels trials) reaches ``Trial.run``, which stops
its environment; the env then makes sure the namespace sandbox of that trial is gone, closes the
proxy session and removes the trial directory before re-raising.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferryman.protocols import GenerateClient
from ferryman.types import SamplingParams, Trajectory

from ferryman_env_harbor.config import HarborEnvConfig

log = logging.getLogger(__name__)

PHASES = (
    ("environment_setup", "env_setup"),
    ("agent_setup", "agent_setup"),
    ("agent_execution", "agent_execute"),
    ("verifier", "verify"),
)
"""Harbor's TimingInfo fields and the names ferryman reports them under (``harbor/<name>_s``)."""


class HarborTrialInvalid(RuntimeError):
    """The trial was not graded or left no valid reward, and the config drops such runs."""


class HarborNoTokens(RuntimeError):
    """The trial made no LLM call through the proxy (e.g. the oracle or nop agent): nothing to train on."""


@dataclass
class TrialOutcome:
    """What one rollout's trial came to."""

    request_id: str
    task_name: str
    status: str
    """``graded`` (valid reward), ``invalid`` (not graded or no valid reward)."""
    reward: float | None
    reason: str | None = None
    """Why the reward is invalid: Harbor's exception type, ``no_reward``, ``missing_reward_key``,
    ``trial_timeout`` or ``create_failed:<type>``."""
    message: str | None = None
    segments: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    exception_type: str | None = None
    """Harbor's recorded exception, if any (also for graded trials, e.g. ``AgentTimeoutError``)."""
    attempts: int = 1
    end_reason: str | None = None
    """The proxy session's end reason (``max_turns``, ``context_length``, …)."""


def _seconds(info: Any) -> tuple[float, float, float] | None:
    if info is None or info.started_at is None or info.finished_at is None:
        return None
    start, end = info.started_at.timestamp(), info.finished_at.timestamp()
    return start, end, max(0.0, end - start)


class HarborEnv:
    """The ``harbor`` env (see the module docstring)."""

    def __init__(self, config: HarborEnvConfig, tokenizer: Any, seed: int = 0) -> None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self._tasks = _resolve_tasks(config.tasks)
        if not self._tasks:
            raise ValueError("harbor env: no tasks found")
        self._agent_class: Any = None
        self._server: Any = None
        self._server_lock: asyncio.Lock | None = None
        self._sem: asyncio.Semaphore | None = None
        self._own_trials_dir = config.trials_dir is None
        self._trials_dir: Path | None = None
        self._running: set[str] = set()
        """Trial names in flight (their sandboxes are reaped at close if anything is left)."""
        self.counters: Counter[str] = Counter()
        self._sums: Counter[str] = Counter()
        self._closed = False

    @classmethod
    def from_config(cls, config: HarborEnvConfig, *, tokenizer: Any, seed: int = 0, **_: Any) -> HarborEnv:
        return cls(config, tokenizer, seed)

    # ------------------------------------------------------------------ Env protocol
    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> dict[str, Any]:
        return {"index": index, **self._tasks[index]}

    async def run(
        self, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams
    ) -> list[Trajectory]:
        outcome = await self.run_trial(task, request_id, client, params)
        if outcome.status != "graded":
            if self.config.on_invalid == "mask" and outcome.segments:
                self.counters["masked"] += 1
                for seg in outcome.segments:
                    seg.reward = float(self.config.masked_reward)
                    seg.response_mask = [0] * len(seg.response_ids)
                    seg.metrics["harbor/masked"] = 1.0
                return outcome.segments
            self.counters["dropped"] += 1
            raise HarborTrialInvalid(
                f"harbor trial {outcome.task_name} ({request_id}) has no valid reward: {outcome.reason}"
                + (f": {outcome.message[:300]}" if outcome.message else "")
            )
        if not outcome.segments:
            self.counters["no_tokens"] += 1
            raise HarborNoTokens(
                f"harbor trial {outcome.task_name} ({request_id}) made no LLM call through the proxy "
                f"(reward {outcome.reward}); nothing to train on"
            )
        return outcome.segments

    # ------------------------------------------------------------------ one trial
    async def run_trial(
        self, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams
    ) -> TrialOutcome:
        """Run the task's trial (with retries) and return its outcome; never raises for a failed
        trial (only for cancellation)."""
        if self._closed:
            raise RuntimeError("harbor env: closed")
        server = await self._ensure_server()
        if self._sem is None and self.config.max_concurrent_trials:
            self._sem = asyncio.Semaphore(self.config.max_concurrent_trials)
        attempts = 0
        while True:
            attempts += 1
            if self._sem is not None:
                async with self._sem:
                    outcome, retryable = await self._attempt(server, task, request_id, client, params, attempts)
            else:
                outcome, retryable = await self._attempt(server, task, request_id, client, params, attempts)
            outcome.attempts = attempts
            if outcome.status == "graded" or not retryable or attempts > self.config.retries:
                break
            self.counters["retried"] += 1
        self._account(outcome)
        return outcome

    async def _attempt(
        self, server: Any, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams, attempt: int
    ) -> tuple[TrialOutcome, bool]:
        from harbor.trial.trial import Trial

        name = task["name"]
        trial_name = f"{name[:32].rstrip('_-')}__{request_id[-12:]}__{attempt}"
        sess = server.open_session(request_id=request_id, params=params, client=client)
        trial_dir = self.trials_dir / trial_name
        self._running.add(trial_name)
        result = None
        t0 = time.time()
        outcome = TrialOutcome(request_id=request_id, task_name=name, status="invalid", reward=None)
        retryable = False
        try:
            try:
                cfg = self._trial_config(task, trial_name, sess)
                trial = await Trial.create(cfg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Harbor refused the task or config: counted, never retried
                outcome.reason = f"create_failed:{type(e).__name__}"
                outcome.message = str(e)
                log.warning("harbor trial %s: Trial.create failed: %s", trial_name, e)
            else:
                try:
                    if self.config.trial_timeout_sec is not None:
                        result = await asyncio.wait_for(trial.run(), self.config.trial_timeout_sec)
                    else:
                        result = await trial.run()
                except TimeoutError:
                    outcome.reason = "trial_timeout"
                    outcome.message = f"the trial ran longer than trial_timeout_sec={self.config.trial_timeout_sec}"
                except asyncio.CancelledError:
                    self.counters["cancelled"] += 1
                    raise
        finally:
            # whatever happened (Harbor stops its environment in a shielded task, which a cancellation
            # does not wait for), no sandbox of this trial outlives it
            await self._reap_sandboxes(trial_name)
            self._running.discard(trial_name)
            session_result = await asyncio.shield(server.close_session(sess))
            if not self.config.keep_trials:
                await asyncio.to_thread(shutil.rmtree, trial_dir, True)
        outcome.segments = list(session_result.trajectories)
        outcome.end_reason = session_result.end_reason
        outcome.metrics.update({k: float(v) for k, v in session_result.metrics.items()})
        outcome.metrics["harbor/trial_s"] = time.time() - t0
        if result is not None:
            retryable = self._read_result(result, outcome)
        for seg in outcome.segments:
            seg.reward = outcome.reward
            seg.metrics.update(outcome.metrics)
            seg.timings.update(outcome.timings)
            seg.extra["harbor"] = {
                "task": name,
                "trial_name": trial_name,
                "status": outcome.status,
                "reason": outcome.reason,
                "exception": outcome.exception_type,
                "end_reason": outcome.end_reason,
            }
        return outcome, retryable

    def _read_result(self, result: Any, outcome: TrialOutcome) -> bool:
        """Fill ``outcome`` from Harbor's TrialResult; returns whether a retry may help."""
        for attr, short in PHASES:
            span = _seconds(getattr(result, attr, None))
            if span is not None:
                start, end, dur = span
                outcome.metrics[f"harbor/{short}_s"] = dur
                outcome.timings[f"harbor/{short}_start"] = start
                outcome.timings[f"harbor/{short}_end"] = end
        ctx = result.agent_result
        if ctx is not None:
            for key in ("n_input_tokens", "n_output_tokens"):
                value = getattr(ctx, key, None)
                if value is not None:
                    outcome.metrics[f"harbor/agent_{key}"] = float(value)
        exc = result.exception_info
        if exc is not None:
            outcome.exception_type = exc.exception_type
            outcome.message = exc.exception_message
        rewards = result.verifier_result.rewards if result.verifier_result is not None else None
        if not result.reward_valid:
            outcome.reason = exc.exception_type if exc is not None else "no_reward"
            return bool(exc is not None and exc.policy.should_retry)
        value = (rewards or {}).get(self.config.reward_key)
        if value is None:
            outcome.reason = "missing_reward_key"
            outcome.message = f"verifier rewards {sorted(rewards or {})} lack {self.config.reward_key!r}"
            return False
        outcome.status = "graded"
        outcome.reward = float(value)
        return False

    def _trial_config(self, task: dict[str, Any], trial_name: str, sess: Any) -> Any:
        from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig, VerifierConfig

        agent = dict(self.config.agent)
        agent.setdefault("model_name", f"{self.config.litellm_provider}/{sess.model_name}")
        env_vars = {"OPENAI_BASE_URL": sess.base_url, "OPENAI_API_BASE": sess.base_url, "OPENAI_API_KEY": "ferryman-proxy"}
        agent["env"] = {**env_vars, **dict(agent.get("env") or {})}
        if self._supports_base_url(agent):
            agent["base_url"] = sess.base_url
        from ferryman_env_harbor.config import SANDBOX_IMPORT_PATH
        from ferryman_env_harbor.contain import LIMIT_ERROR_POLICY

        environment = dict(self.config.environment)
        if environment.get("import_path") == SANDBOX_IMPORT_PATH:
            # the namespace sandbox forwards this session (and only it) into its network namespace
            environment["kwargs"] = {**dict(environment.get("kwargs") or {}), "proxy_url": sess.base_url}
        trial = dict(self.config.trial)
        # a sandbox limit breach (fork bomb, memory hog, disk fill): not graded, no valid reward
        trial["override_error_policy"] = {**LIMIT_ERROR_POLICY, **dict(trial.get("override_error_policy") or {})}
        return TrialConfig(
            task=TaskConfig.model_validate(task["task"]),
            trial_name=trial_name,
            trials_dir=self.trials_dir,
            agent=AgentConfig.model_validate(agent),
            environment=EnvironmentConfig.model_validate(environment),
            verifier=VerifierConfig.model_validate(self.config.verifier),
            **trial,
        )

    def _supports_base_url(self, agent: dict[str, Any]) -> bool:
        """Harbor refuses ``base_url`` for agents without a model connection (oracle, nop, …);
        those get the endpoint through ``OPENAI_BASE_URL`` only."""
        cls = self._load_agent_class()
        caps = getattr(cls, "capabilities", None)
        return bool(getattr(caps, "base_url", False)) and getattr(cls, "MODEL_CONNECTION", None) is not None

    def _load_agent_class(self) -> Any:
        """The agent's class (importing it imports what it needs: LiteLLM for terminus-2)."""
        if self._agent_class is None:
            from harbor.agents.factory import AgentFactory
            from harbor.models.agent.name import AgentName
            from harbor.trial.trial import Trial  # noqa: F401 - loaded here, off the event loop
            from harbor.utils.import_path import import_class

            agent = self.config.agent
            if agent.get("import_path"):
                path = agent["import_path"]
            else:
                try:
                    path = getattr(AgentFactory, "_AGENT_MAP", {})[AgentName(agent["name"])]
                except (KeyError, ValueError):
                    raise ValueError(f"harbor env: unknown Harbor agent {agent['name']!r}") from None
            self._agent_class = import_class(path, label="agent")
        return self._agent_class

    async def _reap_sandboxes(self, trial_name: str) -> None:
        """Make sure the namespace sandboxes of ``trial_name`` are stopped and removed (Harbor
        stops its environment on cancellation, but in a shielded task that may outlive us)."""
        from ferryman_env_harbor.sandbox import live_sessions, stop_sessions

        if not live_sessions(trial_name):
            return
        try:
            await asyncio.wait_for(asyncio.shield(stop_sessions(trial_name)), 30)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - cleanup is best effort; a leak is logged
            log.warning("harbor trial %s: sandbox cleanup failed: %r", trial_name, e)

    # ------------------------------------------------------------------ accounting
    def _account(self, outcome: TrialOutcome) -> None:
        c = self.counters
        c["trials"] += 1
        c[outcome.status] += 1
        if outcome.exception_type:
            c[f"exception/{outcome.exception_type}"] += 1
        if outcome.reason and outcome.status != "graded":
            c[f"invalid/{outcome.reason.split(':', 1)[0]}"] += 1
        if outcome.end_reason:
            c[f"end/{outcome.end_reason}"] += 1
        if outcome.reward is not None:
            self._sums["reward"] += outcome.reward
        for _, short in PHASES:
            key = f"harbor/{short}_s"
            if key in outcome.metrics:
                self._sums[short] += outcome.metrics[key]
                self._sums[f"n_{short}"] += 1

    def stats(self) -> dict[str, float]:
        """Counters and mean phase times since the env was made (``harbor/…``), and the
        proxy's own counters (``proxy/…``)."""
        out = self._server.stats() if self._server is not None else {}
        out.update({f"harbor/{k}": float(v) for k, v in self.counters.items()})
        if self.counters["graded"]:
            out["harbor/reward_mean"] = self._sums["reward"] / self.counters["graded"]
        for _, short in PHASES:
            n = self._sums[f"n_{short}"]
            if n:
                out[f"harbor/{short}_s_mean"] = self._sums[short] / n
        return out

    # ------------------------------------------------------------------ resources
    @property
    def trials_dir(self) -> Path:
        if self._trials_dir is None:
            if self.config.trials_dir is not None:
                self._trials_dir = Path(self.config.trials_dir).resolve()
                self._trials_dir.mkdir(parents=True, exist_ok=True)
            else:
                self._trials_dir = Path(tempfile.mkdtemp(prefix="ferryman-harbor-trials-"))
        return self._trials_dir

    async def _ensure_server(self) -> Any:
        if self._server is not None:
            return self._server
        if self._server_lock is None:
            self._server_lock = asyncio.Lock()
        async with self._server_lock:
            if self._server is None:
                from ferryman_proxy import ProxyServer

                # Harbor and the agent's libraries take seconds to import: not on the event loop
                await asyncio.to_thread(self._load_agent_class)

                server = ProxyServer(tokenizer=self.tokenizer, config=self.config.proxy)
                await server.start()
                self._server = server
        return self._server

    @property
    def proxy(self) -> Any:
        """The proxy server (``None`` before the first run)."""
        return self._server

    async def aclose(self) -> None:
        """Stop the proxy and remove the env's own trials directory. Idempotent."""
        self._closed = True
        from ferryman_env_harbor.sandbox import stop_sandboxes

        if self._running:  # trials still running at close (their runs were not awaited)
            await stop_sandboxes([f"{name}__" for name in self._running])
        server, self._server = self._server, None
        if server is not None:
            await server.stop()
        if self._own_trials_dir and self._trials_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._trials_dir, True)
            self._trials_dir = None


def _resolve_tasks(entries: list[str | dict[str, Any]]) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    for entry in entries:
        if isinstance(entry, dict):
            name = str(entry.get("name") or entry.get("path") or entry.get("git_url") or "task")
            tasks.append({"name": name.rstrip("/").split("/")[-1], "task": dict(entry)})
            continue
        path = Path(entry).resolve()
        dirs = [path] if (path / "task.toml").is_file() else sorted(c for c in path.iterdir() if (c / "task.toml").is_file())
        for d in dirs:
            tasks.append({"name": d.name, "task": {"path": str(d)}})
    return tasks
