"""Builds a run from its config and drives it: MessageQueue, engine replicas, Rollouter, Trainer.

With ``runtime: ray`` each role is a Ray actor (the Rollouter, the MessageQueue, one actor per
engine replica, the Trainer); with ``runtime: inline`` the same objects share one asyncio
loop in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ferryman import faults, trace
from ferryman.checkpoint import (
    CheckpointError,
    Checkpointer,
    RollouterDiedError,
    RunDiedError,
    TrainerDiedError,
    TrainingStalledError,
    find_checkpoint,
    read_meta,
)
from ferryman.client import ServerClient
from ferryman.cluster import Placement, cluster_nodes, connect, plan_placement, resolve_address, set_control_actor_options
from ferryman.cluster.connect import no_uv_run_workers
from ferryman.cluster.tuning import tune_control_plane_gc
from ferryman.config import ConfigError, RunConfig, missing_requirements, validate_plugin_sections
from ferryman.engine_host import EngineHandle, spawn_engine_actors
from ferryman.plugins import PluginError, PluginHost
from ferryman.quiet import quiet_transformers
from ferryman.rollouter import AgentRunsFailingError, Rollouter
from ferryman.sync import Synchronizer
from ferryman.trainer_loop import Trainer
from ferryman.types import SamplingParams

log = logging.getLogger(__name__)

EXIT_STOPPED = 75
"""Exit status of ``ferryman train`` after a stop on SIGTERM (a checkpoint was saved; run it
again with ``--resume``): EX_TEMPFAIL."""


def _load_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError("model: loading a tokenizer needs transformers (pip install 'ferryman[tiny]')") from e
    return AutoTokenizer.from_pretrained(path)


def prepare_model(cfg: RunConfig) -> None:
    """Build the tiny model if asked to and the directory is missing."""
    path = Path(cfg.model.path)
    if cfg.model.build_tiny:
        from ferryman.tiny import build_tiny_model

        build_tiny_model(path, **cfg.model.tiny_build_kwargs(cfg.seed))
    elif not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {str(path)!r} is not a model directory (no config.json); set model.build_tiny=true to build a tiny one")


@contextlib.contextmanager
def tokenizer_for_checks(cfg: RunConfig) -> Iterator[Any]:
    """The run's tokenizer for :func:`check_env` without building anything in place: the model
    directory's, or (``model.build_tiny`` and not built yet) a tiny model's built in a temporary
    directory."""
    path = Path(cfg.model.path)
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        yield _load_tokenizer(str(path))
        return
    if not cfg.model.build_tiny:
        raise ConfigError(f"model.path: {str(path)!r} is not a model directory (no tokenizer); set model.build_tiny=true to build a tiny one")
    from ferryman.tiny import build_tiny_model

    m = cfg.model
    with tempfile.TemporaryDirectory(prefix="ferryman-check-") as tmp:
        built = build_tiny_model(
            Path(tmp) / "tiny", vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_num_layers,
            init_std=m.tiny_init_std, max_positions=m.tiny_max_positions, seed=cfg.seed,
        )
        yield _load_tokenizer(str(built))


def check_env(cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], tokenizer: Any = None) -> int:
    """Before anything starts: build the env once, as the Rollouter will, and check that it has
    at least one task and that ``get_task(0)`` is JSON (tasks go into checkpoints and traces).
    Returns the number of tasks; raises :class:`ConfigError` naming the env otherwise."""
    section = plugin_cfgs["env"]
    name = f"the {section.type!r} env"
    if tokenizer is None:
        tokenizer = _load_tokenizer(cfg.model.path)
    try:
        env = host.create("env", section, tokenizer=tokenizer, seed=cfg.seed)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the plugin raised, before anything started
        raise ConfigError(f"env: {name} could not be built: {e!r}") from e
    try:
        try:
            num = env.num_tasks()
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"env: num_tasks() of {name} raised {e!r}") from e
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ConfigError(f"env: {name} has no tasks (num_tasks() returned {num!r}); a run needs at least one")
        try:
            task = env.get_task(0)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"env: get_task(0) of {name} raised {e!r}") from e
        try:
            json.dumps(task, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"env: get_task(0) of {name} is not JSON ({type(task).__name__}: {e}); tasks go into checkpoints "
                "and traces, so they must be plain dicts, lists, strings and numbers"
            ) from None
        return num
    finally:
        close = getattr(env, "aclose", None)
        if close is not None:
            asyncio.run(close())


# --------------------------------------------------------------------------- role builders


def build_rollouter(cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], queue: Any, engines: list[Any]) -> Rollouter:
    tokenizer = _load_tokenizer(cfg.model.path)
    env = faults.wrap_env(host.create("env", plugin_cfgs["env"], tokenizer=tokenizer, seed=cfg.seed))
    router = host.create("router", plugin_cfgs["router"], replicas=[e.name for e in engines], seed=cfg.seed)
    client = ServerClient(router, {e.name: e for e in engines}, partial_rollout=cfg.async_training.partial_rollout)
    funnel = cfg.funnel()
    sampling = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
    return Rollouter(
        env=env,
        client=client,
        queue=queue,
        n=cfg.rollout.n,
        sampling=sampling,
        max_required_samples=funnel["max_required_samples"],
        max_concurrent_samples=funnel["max_concurrent_samples"],
        total_samples=cfg.rollout.total_rollout_steps,
        seed=cfg.seed,
        on_sample=lambda s: host.notify("ferryman_on_sample_produced", sample=s),
        run_timeout_s=cfg.rollout.run_timeout_s,
        failures=cfg.rollout.failures,
    )


def build_validator(cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], rollouter: Rollouter) -> Any:
    """The run's :class:`~ferryman.evaluation.Validator` (None without ``validation``), over the
    Rollouter's own client (router, engines). With ``validation.split`` the Rollouter's env is
    narrowed to the training share here, before it admits anything."""
    from ferryman.evaluation import Validator, split_env

    v = cfg.validation
    if not v.enabled:
        return None
    if v.env is not None:
        env = host.create("env", plugin_cfgs["validation_env"], tokenizer=_load_tokenizer(cfg.model.path), seed=cfg.seed + 1)
    elif v.split is not None:
        try:
            rollouter.env, env = split_env(rollouter.env, v.split)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        env = rollouter.env  # the training tasks themselves
    sampling = SamplingParams(
        max_tokens=v.max_tokens or cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature if v.temperature is None else v.temperature,
        top_p=v.top_p,
    )
    return Validator(env, rollouter.client, n=v.n, sampling=sampling, num_tasks=v.num_tasks,
                     success_threshold=v.success_threshold, concurrency=v.concurrency)


def build_trainer(
    cfg: RunConfig,
    host: PluginHost,
    plugin_cfgs: dict[str, Any],
    queue: Any,
    engines: list[Any],
    rollouter: Any,
    stats_sources: list[Any],
    resume_step: int | None = None,
    validate: Any = None,
) -> tuple[Trainer, list[Any]]:
    tokenizer = _load_tokenizer(cfg.model.path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    backend = host.create("trainer", plugin_cfgs["trainer"], model_path=cfg.model.path, algorithm=cfg.algorithm, seed=cfg.seed)
    if cfg.algorithm.adv_estimator == "gae" and not backend.has_critic:
        raise ConfigError("algorithm.adv_estimator: 'gae' needs a critic; set trainer.use_critic=true or use 'grpo'")
    transport = host.create("weight_sync", plugin_cfgs["weight_sync"])
    trackers = [
        host.create("tracker", t, run_dir=cfg.run_dir, resume_step=resume_step, total_steps=cfg.training.total_steps)
        for t in plugin_cfgs["trackers"]
    ]
    synchronizer = Synchronizer(
        backend=backend,
        transport=transport,
        engines=engines,
        rollouter=rollouter,
        partial_rollout=cfg.async_training.partial_rollout,
        bucket_bytes=int(cfg.training.weight_bucket_megabytes * 2**20),
        on_synced=lambda v, m: host.notify("ferryman_on_weights_synced", version=v, metrics=m),
        max_transfer_attempts=cfg.training.weight_sync_attempts,
        on_replica_lost=rollouter.quarantine_replica,
    )
    checkpointer = Checkpointer(
        cfg.checkpoint, run_dir=cfg.run_dir, backend=backend, queue=queue, synchronizer=synchronizer, rollouter=rollouter
    )

    generated = GeneratedTokens()

    async def on_metrics(step: int, metrics: dict[str, float]) -> None:
        if step % cfg.log_every:
            return
        # the sources are other actors: ask them all at once
        async def ask(source: Any) -> dict[str, float]:
            return await source()

        sources = [*stats_sources, lambda: engine_memory(synchronizer.engines)]
        for result in await asyncio.gather(*(ask(source) for source in sources), return_exceptions=True):
            if isinstance(result, BaseException):  # stats are best effort
                log.debug("stats source failed: %r", result)
            else:
                metrics.update(result)
        metrics.update(generated.rates(metrics))
        trainer.report.update(metrics)
        for tracker in trackers:
            tracker.log(metrics, step)

    def on_validation(step: int, metrics: dict[str, float]) -> None:
        for tracker in trackers:
            tracker.log(metrics, step)

    trainer = Trainer(
        cfg=cfg,
        backend=backend,
        queue=queue,
        synchronizer=synchronizer,
        pad_token_id=int(pad),
        on_metrics=on_metrics,
        on_step_end=lambda step, m: host.notify("ferryman_on_step_end", step=step, metrics=m),
        checkpointer=checkpointer,
        validate=validate,
        on_validation=on_validation,
    )
    return trainer, trackers


class GeneratedTokens:
    """Generated tokens/s from the Rollouter's counters (``rollouter/generated_tokens`` and
    ``rollouter/elapsed_s``, both on the Rollouter's clock): ``perf/generated_tokens_per_s`` since
    the previous report, ``perf/generated_tokens_per_s_avg`` over the run."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def rates(self, metrics: dict[str, float]) -> dict[str, float]:
        tokens, elapsed = metrics.get("rollouter/generated_tokens"), metrics.get("rollouter/elapsed_s")
        if tokens is None or elapsed is None or elapsed <= 0:
            return {}
        out = {"perf/generated_tokens_per_s_avg": tokens / elapsed}
        if self._last is not None and elapsed > self._last[1] and tokens >= self._last[0]:
            out["perf/generated_tokens_per_s"] = (tokens - self._last[0]) / (elapsed - self._last[1])
        else:  # the first report (or a Rollouter restored from a checkpoint): the run so far
            out["perf/generated_tokens_per_s"] = out["perf/generated_tokens_per_s_avg"]
        self._last = (tokens, elapsed)
        return out


async def engine_memory(engines: list[Any]) -> dict[str, float]:
    """Each replica's peak memory (``memory/engine_rss_peak_gb/<replica>``, and
    ``memory/engine_device_peak_gb/<replica>`` on a GPU); replicas that do not answer are left out."""
    results = await asyncio.gather(*(asyncio.wait_for(e.peak_memory(), 10) for e in engines), return_exceptions=True)
    out: dict[str, float] = {}
    for e, r in zip(engines, results):
        if isinstance(r, dict):
            out.update({f"memory/{k}/{e.name}": float(v) for k, v in r.items()})
    return out


# --------------------------------------------------------------------------- Ray actors


class RolloutActor:
    def __init__(self, cfg: RunConfig, queue: Any, engines: list[EngineHandle]) -> None:
        tune_control_plane_gc()
        quiet_transformers()
        trace.configure(cfg.run_dir, cfg.trace.level, proc="rollouter")
        host = PluginHost()
        plugin_cfgs = validate_plugin_sections(cfg, host)
        self.rollouter = build_rollouter(cfg, host, plugin_cfgs, queue, engines)
        self.validator = build_validator(cfg, host, plugin_cfgs, self.rollouter)

    async def validate(self, step: int, version: int) -> dict[str, float]:
        assert self.validator is not None
        return await self.validator.run(step, version)

    async def fit(self) -> None:
        await self.rollouter.fit()

    async def pause_for_sync(self, wait_for_active: bool) -> float:
        return await self.rollouter.pause_for_sync(wait_for_active)

    async def reset_staleness(self, version: int) -> int:
        return await self.rollouter.reset_staleness(version)

    async def stop(self) -> None:
        await self.rollouter.stop()

    async def checkpoint_state(self, sync_version: int | None) -> dict[str, Any]:
        return await self.rollouter.checkpoint_state(sync_version)

    async def restore_state(self, state: dict[str, Any], exclude_uids: list[str]) -> dict[str, float]:
        return await self.rollouter.restore_state(state, exclude_uids)

    async def freeze(self) -> None:
        await self.rollouter.freeze()

    async def quarantine_replica(self, replica: str, error: str) -> None:
        await self.rollouter.quarantine_replica(replica, error)

    async def stats(self) -> dict[str, float]:
        out = self.rollouter.stats()
        out.update(await self.rollouter.client.router.stats())
        client_stats = getattr(self.rollouter.client, "stats", None)
        if client_stats is not None:
            out.update(client_stats())
        return out

    async def window_log(self) -> list[dict[str, Any]]:
        return self.rollouter.window_log()

    def node(self) -> dict[str, str]:
        return _this_node()


def _this_node() -> dict[str, str]:
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address()}


class _RemoteRollouter:
    """Lets the Synchronizer await a Rollouter actor like a local object."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def pause_for_sync(self, wait_for_active: bool) -> float:
        return await self.actor.pause_for_sync.remote(wait_for_active)

    async def reset_staleness(self, version: int) -> int:
        return await self.actor.reset_staleness.remote(version)

    async def checkpoint_state(self, sync_version: int | None) -> dict[str, Any]:
        return await self.actor.checkpoint_state.remote(sync_version)

    async def restore_state(self, state: dict[str, Any], exclude_uids: list[str]) -> dict[str, float]:
        return await self.actor.restore_state.remote(state, exclude_uids)

    async def freeze(self) -> None:
        await self.actor.freeze.remote()

    async def quarantine_replica(self, replica: str, error: str) -> None:
        await self.actor.quarantine_replica.remote(replica, error)


def _gpu_ids() -> list[Any]:
    """The GPUs Ray gave this actor (``ray.trainer.num_gpus``), for the summary."""
    import ray

    try:
        return list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - a number for the record only
        return []


class TrainerActor:
    def __init__(
        self, cfg: RunConfig, queue: Any, engines: list[EngineHandle], rollouter_actor: Any, resume_step: int | None = None
    ) -> None:
        import torch

        torch.set_num_threads(cfg.trainer_threads)
        quiet_transformers()
        trace.configure(cfg.run_dir, cfg.trace.level, proc="trainer")
        host = PluginHost()
        self.queue = queue
        sources = [lambda: rollouter_actor.stats.remote(), queue.stats]

        async def validate(step: int, version: int) -> dict[str, float]:
            return await rollouter_actor.validate.remote(step, version)

        self.trainer, self.trackers = build_trainer(
            cfg, host, validate_plugin_sections(cfg, host), queue, engines, _RemoteRollouter(rollouter_actor), sources, resume_step,
            validate=validate if cfg.validation.enabled else None,
        )

    async def restore(self, path: str) -> dict[str, Any]:
        assert self.trainer.checkpointer is not None
        return await self.trainer.checkpointer.restore(path)

    def request_stop(self) -> None:
        self.trainer.request_stop()

    def node(self) -> dict[str, str]:
        return _this_node()

    async def fit(self) -> dict[str, Any]:
        try:
            records = await self.trainer.fit()
        finally:
            self.trainer.synchronizer.close()
            for t in self.trackers:
                t.close()
            trace.close()
        ck = self.trainer.checkpointer
        return {
            "steps": records,
            "syncs": self.trainer.synchronizer.history,
            "stopped": self.trainer.stop_requested,
            "checkpoints": ck.saved if ck else [],
            "resumed": ck.restored if ck else None,
            "lost_replicas": self.trainer.synchronizer.lost,
            "report": self.trainer.report.summary(),
            "trainer_gpu_ids": _gpu_ids(),
        }


# --------------------------------------------------------------------------- driver


def _on_sigterm(cfg: RunConfig, request_stop: Any) -> Any:
    """Install a SIGTERM handler on the running loop (main thread only); returns its remover."""
    if not cfg.checkpoint.on_sigterm:
        return lambda: None
    loop = asyncio.get_running_loop()

    def handler() -> None:
        log.warning("SIGTERM: saving a checkpoint at the next sync boundary, then stopping")
        request_stop()

    try:
        loop.add_signal_handler(signal.SIGTERM, handler)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGTERM)


async def _train_while_rolling_out(train: asyncio.Future, rollout: asyncio.Future, close_queue: Any) -> Any:
    """Await the trainer's ``fit``; if the Rollouter's ``fit`` fails first (its actor died, or
    its machinery raised), close the queue so the trainer stops instead of waiting for samples
    that will never come, and raise :class:`RollouterDiedError`. A Rollouter that simply
    finished (every sample admitted) leaves the trainer to train what is queued."""
    await asyncio.wait({train, rollout}, return_when=asyncio.FIRST_COMPLETED)
    if not train.done() and rollout.done() and not rollout.cancelled() and rollout.exception() is not None:
        err = _cause(rollout.exception())
        log.error("the Rollouter failed (%r): stopping the trainer", err)
        try:
            await close_queue()
        except Exception as e:  # noqa: BLE001 - a dead queue stops the trainer as well
            log.debug("closing the queue: %r", e)
        done, _ = await asyncio.wait({train}, timeout=120)
        if not done:
            train.cancel()
        elif not train.cancelled() and train.exception() is not None:
            log.debug("the trainer stopped with %r", train.exception())
        if isinstance(err, AgentRunsFailingError):  # the env's (or engines') fault, told as such
            raise RollouterDiedError(f"{err}\nthe run stopped") from err
        raise RollouterDiedError(f"the Rollouter failed ({err.__class__.__name__}: {err}); the run stopped") from err
    try:
        return await train
    except Exception as e:
        cause = _cause(e)
        if isinstance(cause, RunDiedError) and cause is not e:  # from a Ray actor: told plainly
            raise type(cause)(str(cause)) from e
        raise


def _cause(err: BaseException) -> BaseException:
    """The error a Ray actor raised (``RayTaskError.cause``), or ``err`` itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


async def _run_inline(
    cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], resume: Path | None = None, resume_step: int | None = None
) -> dict[str, Any]:
    funnel = cfg.funnel()
    if plugin_cfgs["queue"].type != "local":
        # one process: the MessageQueue is the in-process one whatever queue.type names
        log.info("runtime 'inline': queue.type %r replaced by the in-process 'local' queue", plugin_cfgs["queue"].type)
    queue = host.create("queue", plugin_cfgs["queue"].model_copy(update={"type": "local"}), maxsize=funnel["max_queue_size"])
    engines = []
    for i in range(cfg.rollout.num_replicas):
        name = f"replica-{i}"
        engine = host.create("engine", plugin_cfgs["engine"], model_path=cfg.model.path, replica=name, seed=cfg.seed + i)
        engine = faults.wrap_engine(engine, name)
        engines.append(EngineHandle(name, engine=engine))
    for e in engines:  # one at a time: model loading in one process is not thread-safe
        await e.start()
    rollouter = build_rollouter(cfg, host, plugin_cfgs, queue, engines)
    validator = build_validator(cfg, host, plugin_cfgs, rollouter)

    async def rollouter_stats() -> dict[str, float]:
        return {**rollouter.stats(), **(await rollouter.client.router.stats())}

    trainer, trackers = build_trainer(
        cfg, host, plugin_cfgs, queue, engines, rollouter, [rollouter_stats, queue.stats], resume_step,
        validate=validator.run if validator is not None else None,
    )
    ck = trainer.checkpointer
    remove_handler = _on_sigterm(cfg, trainer.request_stop)
    fit = None
    try:
        if resume is not None:
            await ck.restore(resume)
        fit = asyncio.create_task(rollouter.fit())
        records = await _train_while_rolling_out(asyncio.create_task(trainer.fit()), fit, queue.close)
    finally:
        remove_handler()
        await rollouter.stop()
        await queue.close()
        if fit is not None:
            fit.cancel()
            await asyncio.gather(fit, return_exceptions=True)
        trainer.synchronizer.close()
        for t in trackers:
            t.close()
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)
        trainer.backend.close()
    return {
        "steps": records,
        "syncs": trainer.synchronizer.history,
        "windows": rollouter.window_log(),
        "rollouter": rollouter.stats(),
        "funnel": funnel,
        "stopped": trainer.stop_requested,
        "checkpoints": ck.saved,
        "resumed": ck.restored,
        "lost_replicas": trainer.synchronizer.lost,
        "report": trainer.report.summary(),
        "validation": validator.history if validator is not None else [],
    }


async def _run_ray(
    cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], resume: Path | None = None, resume_step: int | None = None
) -> dict[str, Any]:
    import ray

    funnel = cfg.funnel()
    placement = Placement(plan_placement(cfg))
    layout = await placement.reserve()  # a cluster that cannot hold the run fails here, before anything starts
    try:
        return await _run_placed(cfg, host, plugin_cfgs, placement, layout, funnel, resume, resume_step)
    finally:
        placement.release()
        set_control_actor_options({})


def _control_options(cfg: RunConfig) -> dict[str, Any]:
    """Ray options that keep the control plane (Rollouter, MessageQueue) on the driver's node."""
    if not cfg.ray.control_on_driver_node:
        return {}
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)}


async def _run_placed(
    cfg: RunConfig, host: PluginHost, plugin_cfgs: dict[str, Any], placement: Placement, layout: dict[str, Any],
    funnel: dict[str, int], resume: Path | None, resume_step: int | None,
) -> dict[str, Any]:
    import ray

    control = _control_options(cfg)
    set_control_actor_options(control)
    queue = host.create("queue", plugin_cfgs["queue"], maxsize=funnel["max_queue_size"], trace_to=(cfg.run_dir, cfg.trace.level))
    engines = spawn_engine_actors(
        cfg.engine, model_path=cfg.model.path, num_replicas=cfg.rollout.num_replicas, seed=cfg.seed, num_threads=cfg.engine_threads,
        actor_options=placement.engine_options,
    )
    await asyncio.gather(*(e.start() for e in engines))
    rollouter = ray.remote(num_cpus=0, max_concurrency=1000)(RolloutActor).options(**control).remote(cfg, queue, engines)
    trainer = (
        ray.remote(max_concurrency=100)(TrainerActor).options(**placement.trainer_options()).remote(cfg, queue, engines, rollouter, resume_step)
    )
    remove_handler = _on_sigterm(cfg, lambda: trainer.request_stop.remote())
    fit_ref = None
    nodes: dict[str, Any] = {}
    try:
        nodes = await _where(engines, rollouter, trainer)  # (a trainer that fails to start raises here)
        log.info("placement: %s", nodes)
        if resume is not None:
            await trainer.restore.remote(str(resume))
        fit_ref = rollouter.fit.remote()
        train_ref = trainer.fit.remote()
        result = await _train_while_rolling_out(
            asyncio.wrap_future(train_ref.future()), asyncio.wrap_future(fit_ref.future()), queue.close
        )
    except ray.exceptions.RayActorError as e:
        raise TrainerDiedError(f"the trainer died ({e.__class__.__name__}); the run stopped") from e
    finally:
        remove_handler()
        try:
            await rollouter.stop.remote()
        except ray.exceptions.RayActorError as e:  # it died: nothing to stop
            log.debug("stopping the Rollouter: %r", e)
        await queue.close()
        try:
            if fit_ref is not None:
                await asyncio.wait_for(asyncio.wrap_future(fit_ref.future()), 30)
        except Exception as e:  # noqa: BLE001
            log.debug("rollouter fit ended with %r", e)
    result["windows"] = await rollouter.window_log.remote()
    result["rollouter"] = await rollouter.stats.remote()
    result["funnel"] = funnel
    result["placement"] = nodes
    result["cluster"] = {"layout": layout, "nodes": [vars(n) for n in cluster_nodes(all_nodes=True)]}
    return result


async def _where(engines: list[EngineHandle], rollouter: Any, trainer: Any) -> dict[str, Any]:
    """The Ray node (id, address) of every role: ``summary.json``'s ``placement``."""
    refs = {e.name: e._actor.node.remote() for e in engines}  # noqa: SLF001 - core's own handle
    refs["rollouter"] = rollouter.node.remote()
    refs["trainer"] = trainer.node.remote()
    names = list(refs)
    found = await asyncio.gather(*(asyncio.wrap_future(refs[n].future()) for n in names))
    return dict(zip(names, found))


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_ray_auth_warning() -> None:
    """Ray warns at every ``ray.init`` that token authentication is on (its default for a new
    local cluster, which ferryman keeps). Not news for each run: shown only with ``-v`` (when
    ferryman's own INFO messages are shown)."""
    if not logging.getLogger("ferryman").isEnabledFor(logging.INFO):
        logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)


def _resume_point(cfg: RunConfig, resume: str | Path | None) -> tuple[Path | None, int | None]:
    """The checkpoint to resume from and its step. A run directory that has no checkpoint yet
    (the run died before its first one) starts over: ``(None, 0)``."""
    if resume is None:
        return None, None
    try:
        path = find_checkpoint(resume, cfg.checkpoint.dir)
    except CheckpointError:
        if not (Path(resume) / "config.yaml").is_file():
            raise
        log.warning("%s has no checkpoint yet: the run starts over", resume)
        return None, 0
    return path, int(read_meta(path)["step"])


def latest_checkpoint(cfg: RunConfig) -> Path | None:
    from ferryman.checkpoint import CheckpointStore

    return CheckpointStore(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / "checkpoints").latest()


def run(cfg: RunConfig, host: PluginHost | None = None, *, resume: str | Path | None = None) -> dict[str, Any]:
    """Run a whole training job; returns a summary (also written to ``RUN_DIR/summary.json``).

    ``resume``: a run directory (its newest checkpoint is used) or a checkpoint directory; the
    run continues from there with the same step count and samples."""
    host = host or PluginHost()
    resume_path, resume_step = _resume_point(cfg, resume)
    plugin_cfgs = validate_plugin_sections(cfg, host)
    missing = missing_requirements(plugin_cfgs)
    if missing:
        raise PluginError("; ".join(missing))
    if cfg.runtime == "ray" and plugin_cfgs["queue"].type == "local":
        raise ConfigError("queue.type: 'local' lives in one process; with runtime 'ray' use 'ray' (allowed: ray)")
    run_dir = Path(cfg.run_dir)
    quiet_transformers()
    prepare_model(cfg)
    check_env(cfg, host, plugin_cfgs)  # before the run directory, Ray or any engine exists
    run_dir.mkdir(parents=True, exist_ok=True)
    dumped = cfg.model_dump(mode="json")
    # the model section as given: with tiny_preset, a field left unset means "the preset's"
    # (tiny_num_layers, tiny_max_positions), so writing its default would change the model a
    # later build makes, and tiny_hidden_size set beside a preset is refused
    dumped["model"] = cfg.model.model_dump(mode="json", exclude_unset=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dumped, sort_keys=False))
    host.notify("ferryman_on_run_start", config=cfg, run_dir=str(run_dir))
    trace.configure(run_dir, cfg.trace.level, proc="driver")
    trace.instant("run.start", mode=cfg.async_training.mode, funnel=cfg.funnel(), runtime=cfg.runtime)
    t0 = time.time()
    (run_dir / "run.json").write_text(
        json.dumps({"started_at": t0, "mode": cfg.async_training.mode, "funnel": cfg.funnel(), "resumed_from": str(resume_path) if resume_path else None})
    )
    summary: dict[str, Any] = {}
    try:
        if cfg.runtime == "inline":
            summary = asyncio.run(_run_inline(cfg, host, plugin_cfgs, resume_path, resume_step))
        else:
            import ray

            no_uv_run_workers()
            quiet_ray_auth_warning()
            address = resolve_address(cfg.ray.address)
            num_cpus = cfg.ray_num_cpus or max(os.cpu_count() or 1, math.ceil(plan_placement(cfg).local_cpus()))
            started = connect(
                address,
                num_cpus=num_cpus,
                num_gpus=cfg.ray_num_gpus,
                namespace=cfg.ray.namespace,
                env_vars={"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", **faults.worker_env()},
            )
            try:
                summary = asyncio.run(_run_ray(cfg, host, plugin_cfgs, resume_path, resume_step))
            finally:
                if started:
                    ray.shutdown()
    except RunDiedError as e:
        latest = latest_checkpoint(cfg)
        if latest is not None:
            fix = "once the cause is fixed, " if isinstance(e, TrainingStalledError) or isinstance(e.__cause__, AgentRunsFailingError) else ""
            summary["error"] = f"{e}; {fix}resume from {latest} with: ferryman train --resume {run_dir}"
        else:
            summary["error"] = f"{e}; no checkpoint was saved (checkpoint.every_steps), so a new run starts from the beginning"
        raise type(e)(summary["error"]) from e
    finally:
        summary["wall_s"] = time.time() - t0
        summary["started_at"] = t0
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        trace.instant("run.end", wall_s=summary["wall_s"])
        trace.close()
        host.notify("ferryman_on_run_end", run_dir=str(run_dir), metrics={"wall_s": summary["wall_s"]})
    return summary
