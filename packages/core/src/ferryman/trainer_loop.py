"""The Trainer: takes samples one by one, trains, and syncs weights (seed §09's ten steps).

``fit()`` is the whole control loop; each step is a short method named after the seed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import torch

from ferryman import algorithms as algo
from ferryman import metrics as fm
from ferryman import trace
from ferryman.batch import TrainBatch, build_train_batch
from ferryman.checkpoint import TrainingStalledError
from ferryman.config import AlgorithmConfig, RunConfig
from ferryman.faults import hit
from ferryman.protocols import Queue, TrainerBackend
from ferryman.types import Sample

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        backend: TrainerBackend,
        queue: Queue,
        synchronizer: Any,
        pad_token_id: int,
        on_step_end: Any = None,
        on_metrics: Any = None,
        checkpointer: Any = None,
        validate: Any = None,
        on_validation: Any = None,
    ) -> None:
        self.cfg = cfg
        self.alg: AlgorithmConfig = cfg.algorithm
        self.backend = backend
        self.queue = queue
        self.synchronizer = synchronizer
        self.pad_token_id = pad_token_id
        self.on_step_end = on_step_end
        self.on_metrics = on_metrics
        self.required_samples = cfg.required_samples
        self.trigger = cfg.async_training.trigger_parameter_sync_step
        self.current_param_version = 0
        self.local_trigger_step = 0
        self.global_step = 0
        self.step_records: list[dict[str, Any]] = []
        self.checkpointer = checkpointer
        """Takes checkpoints (:class:`ferryman.checkpoint.Checkpointer`); with one, a stop can be
        asked for (:meth:`request_stop`) and is honoured at the next sync boundary."""
        self.stop_requested = False
        self.poll_s = 0.2
        if checkpointer is not None:
            checkpointer.attach(self)
        self._busy_s = 0.0
        self._start = time.monotonic()
        self.colocated = cfg.async_training.colocated
        if self.colocated:
            # the trainer's device memory is the engines' while they generate (backends with
            # offload()/onload(); others keep theirs)
            synchronizer.offload_trainer = True
        self._pending: list[Sample] = []
        """Samples taken from the queue but not trained yet (colocated: the whole window)."""
        self._taken_at: dict[str, float] = {}
        self._samples_total = 0
        self._prefetch: asyncio.Task[bool] | None = None
        """Takes the next local step's samples while this one trains (same window only)."""
        self._publish: asyncio.Task[None] | None = None
        """Reports the previous step's metrics while this one runs."""
        self.nonfinite_grad_steps = 0
        """Steps whose gradient norm was not finite (the backend skipped their update)."""
        self._nonfinite_streak = 0
        self.report = fm.RunReport()
        """What the run reports, summarised (``summary.json``'s ``report``); fed by whoever
        publishes the merged per-step metrics (the runner's ``on_metrics``), or by
        :meth:`_publish_step` when there is no ``on_metrics``."""
        self.validate = validate
        """``async validate(step, version) -> metrics`` (:class:`ferryman.evaluation.Validator`
        where the Rollouter runs), or None; ``on_validation(step, metrics)`` reports them."""
        self.on_validation = on_validation
        self._validation: asyncio.Task[None] | None = None

    async def fit(self) -> list[dict[str, Any]]:
        try:
            if self.global_step == 0 and self.cfg.validation.before_train:
                self._start_validation(0)
            records = await self._fit()
            await self._validated()
            return records
        finally:
            if self._prefetch is not None:  # only left over when a step failed
                self._prefetch.cancel()
                self._prefetch = None
            if self._validation is not None:
                self._validation.cancel()
            await self._published()

    # ------------------------------------------------------------------ validation
    def _start_validation(self, step: int) -> None:
        """Validate at the engines' current weights, next to training. It is awaited before the
        next weight sync (so all its tokens come from this version) or at once in colocated
        mode (the engines sleep while the Trainer trains)."""
        if self.validate is None:
            return
        if self._validation is not None and not self._validation.done():
            # several validations per sync window (every_steps < trigger): one at a time
            log.warning("validation at step %d skipped: the one before is still running", step)
            return

        async def run(version: int) -> None:
            m = await _maybe_await(self.validate(step, version))
            if self.on_validation is not None:
                await _maybe_await(self.on_validation(step, m))

        self._validation = asyncio.create_task(run(self.current_param_version))

    async def _validated(self) -> float:
        """Wait for a validation in progress; returns the wait."""
        if self._validation is None:
            return 0.0
        t0 = time.monotonic()
        task, self._validation = self._validation, None
        await task
        return time.monotonic() - t0

    async def _fit(self) -> list[dict[str, Any]]:
        if self.colocated:
            await self._validated()
        if self.colocated and self.global_step < self.cfg.training.total_steps:
            await self.synchronizer.park_trainer(self.current_param_version)
        while self.global_step < self.cfg.training.total_steps:
            t_step = time.monotonic()
            samples, wait_s = await self._fit_generate()
            if samples is None:
                if self.stop_requested and self.checkpointer is not None:
                    await self.checkpointer.save_final()
                log.info("queue closed or stop asked for: trainer stops at step %d", self.global_step)
                break
            t_train = time.monotonic()
            self._start_prefetch()
            batch = build_train_batch(samples, self.pad_token_id)
            # the engine reports log-probs at its sampling temperature; the trainer must match
            batch.meta["temperature"] = self.cfg.rollout.temperature
            m: dict[str, float] = {}
            self._fit_compute_reward(batch, samples, m)
            # compute runs in a worker thread so the actor's event loop stays responsive
            await asyncio.to_thread(self._fit_compute_log_prob, batch, m)
            await asyncio.to_thread(self._fit_compute_ref_log_prob, batch)
            await asyncio.to_thread(self._fit_compute_critic, batch)
            self._fit_compute_advantage(batch, m)
            await asyncio.to_thread(self._fit_update_critic, batch, m)
            await asyncio.to_thread(self._fit_update_actor, batch, m)
            self._check_gradients(m)
            trained_version = self.current_param_version
            self._staleness_metrics(batch, samples, m)
            train_s = time.monotonic() - t_train
            self._trace_train(batch, samples, trained_version, t_train, train_s)
            self._fit_update_local_step()
            if self.local_trigger_step >= self.trigger and self._validation is not None:
                m["timing/wait_validation_s"] = await self._validated()
            sync_metrics = await self._fit_update_weights()
            m.update(sync_metrics)
            self.global_step += 1
            every = self.cfg.validation.every_steps
            if every and self.global_step % every == 0:
                self._start_validation(self.global_step)
                if self.colocated:
                    await self._validated()
            self._busy_s += train_s
            self._throughput_metrics(batch, samples, time.monotonic() - t_step, train_s, m)
            trace.complete("trainer.step", trace.wall(t_step), time.monotonic() - t_step, step=self.global_step, version=trained_version)
            m.update(
                {
                    "trainer/step": float(self.global_step),
                    "trainer/version": float(trained_version),
                    "timing/wait_samples_s": wait_s,
                    "timing/train_s": train_s,
                    "timing/step_s": time.monotonic() - t_step,
                    "trainer/idle_ratio": 1.0 - self._busy_s / max(time.monotonic() - self._start, 1e-9),
                    "perf/tokens": float(batch.num_tokens),
                }
            )
            self.step_records.append(
                {
                    "step": self.global_step,
                    "version": trained_version,
                    "sample_uids": [s.uid for s in samples],
                    "min_token_version": int(m["staleness/min_token_version"]),
                    "max_token_version": int(m["staleness/max_token_version"]),
                    "created_versions": [s.created_version for s in samples],
                }
            )
            # the step's metrics go out (stats of the other actors, trackers, observers) while
            # the next step runs; one publication at a time, in step order
            await self._published()
            self._publish = asyncio.create_task(self._publish_step(self.global_step, m))
            if self.checkpointer is not None:
                await self.checkpointer.after_step()
                if self.stop_requested and self.local_trigger_step == 0:
                    break
        if self.step_records and self.nonfinite_grad_steps == len(self.step_records):
            raise TrainingStalledError(
                f"every one of the {len(self.step_records)} trainer steps had a non-finite gradient norm and was "
                "skipped: the run trained nothing (look for non-finite rewards, log-probs or weights)"
            )
        return self.step_records

    def _check_gradients(self, m: dict[str, float]) -> None:
        """Count a step whose gradient norm is not finite (its update was skipped); stop the
        run after ``training.max_nonfinite_grad_steps`` of them in a row."""
        bad = {k: m[k] for k in ("actor/grad_norm", "critic/grad_norm") if k in m and not math.isfinite(m[k])}
        if not bad:
            self._nonfinite_streak = 0
        else:
            self.nonfinite_grad_steps += 1
            self._nonfinite_streak += 1
        m["trainer/nonfinite_grad_steps"] = float(self.nonfinite_grad_steps)
        limit = self.cfg.training.max_nonfinite_grad_steps
        if self._nonfinite_streak >= limit:
            raise TrainingStalledError(
                f"{self._nonfinite_streak} trainer steps in a row (up to step {self.global_step + 1}) had a non-finite "
                f"gradient norm ({', '.join(f'{k}={v}' for k, v in bad.items())}) and were skipped: the run trains "
                f"nothing (limit training.max_nonfinite_grad_steps={limit}; look for non-finite rewards, log-probs or weights)"
            )

    @property
    def pending_samples(self) -> list[Sample]:
        """Samples taken from the queue and not trained yet (part of a checkpoint)."""
        return self._pending

    @pending_samples.setter
    def pending_samples(self, samples: list[Sample]) -> None:
        self._pending = list(samples)

    def request_stop(self) -> None:
        """Stop at the next sync boundary (now if waiting for samples), after a checkpoint."""
        self.stop_requested = True

    # ------------------------------------------------------------------ 1. samples
    async def _fit_generate(self) -> tuple[list[Sample] | None, float]:
        t0 = time.monotonic()
        first = self.local_trigger_step == 0
        want = self.required_samples
        if self.colocated and first:
            # colocated: the whole window is generated before the engines sleep and training starts
            want *= min(self.trigger, self.cfg.training.total_steps - self.global_step)
        if self._prefetch is not None:
            task, self._prefetch = self._prefetch, None
            await task  # what it could not get (queue closed, a stop) the loop below settles
        if not await self._take_into_pending(want):  # closed, or a stop at a sync boundary: _pending is checkpointed
            return None, time.monotonic() - t0
        wait_s = time.monotonic() - t0
        trace.complete("trainer.wait", trace.wall(t0), wait_s, step=self.global_step + 1, first_of_window=first)
        if self.colocated and first:
            await self.synchronizer.sleep_engines(self.current_param_version)
            await self.synchronizer.wake_trainer(self.current_param_version)
        samples, self._pending = self._pending[: self.required_samples], self._pending[self.required_samples :]
        if self.colocated:  # held back by the trainer until now: this is when the sample leaves the queue
            self._taken_at.update((s.uid, time.time()) for s in samples)
        return samples, wait_s

    async def _take_into_pending(self, want: int) -> bool:
        """Take samples from the queue until ``want`` are pending; False if the queue closed
        or a stop was asked for at a sync boundary."""
        while len(self._pending) < want:
            sample = await self._next_sample()
            if sample is None:
                return False
            self._taken_at[sample.uid] = time.time()
            self._pending.append(sample)
        return True

    def _start_prefetch(self) -> None:
        """While this step trains, take the next step's samples, when the next step belongs to
        the same sync window: the queue round trips (and any wait for a late sample) overlap
        training instead of following it. Never across a sync: a sample taken before a sync
        would be missing from the Rollouter's carry-over (its quota) and, in mode (a), would
        come from the weights before the update. Not in colocated mode (it takes a whole window
        at once)."""
        if self.colocated or self.local_trigger_step + 1 >= self.trigger:
            return
        if self.global_step + 1 >= self.cfg.training.total_steps:
            return
        self._prefetch = asyncio.create_task(self._take_into_pending(self.required_samples))

    async def _publish_step(self, step: int, m: dict[str, float]) -> None:
        if self.on_metrics is not None:
            await _maybe_await(self.on_metrics(step, m))
        else:
            self.report.update(m)
        if self.on_step_end is not None:
            self.on_step_end(step, m)

    async def _published(self) -> None:
        """Wait for the previous step's metrics to be reported (errors surface here)."""
        if self._publish is not None:
            task, self._publish = self._publish, None
            await task

    async def _next_sample(self) -> Sample | None:
        """The next sample; None once the queue is closed or (with a checkpointer) a stop was
        asked for at a sync boundary."""
        if self.checkpointer is None:
            return await self.queue.get()
        while not (self.stop_requested and self.local_trigger_step == 0):
            sample = await self.queue.get(timeout=self.poll_s)
            if sample is not None:
                hit("trainer.get")
                return sample
            if (await self.queue.stats()).get("queue/closed"):
                return None
        return None

    # ------------------------------------------------------------------ 2. reward
    @trace.traced("reward")
    def _fit_compute_reward(self, batch: TrainBatch, samples: list[Sample], m: dict[str, float]) -> None:
        # the env's verifier already scored each trajectory; batch.scores holds it
        scores = batch.scores
        m["reward/mean"] = float(scores.mean())
        m["reward/max"] = float(scores.max())
        m["reward/min"] = float(scores.min())
        resp_len = batch.loss_mask.sum(-1)
        m["response/length_mean"] = float(resp_len.mean())
        m["response/aborted_ratio"] = float(sum(1 for s in samples for t in s.trajectories if t.num_aborts) / batch.batch_size)

    # ------------------------------------------------------------------ 3. old log-prob
    @trace.traced("log_prob")
    def _fit_compute_log_prob(self, batch: TrainBatch, m: dict[str, float]) -> None:
        every = self.cfg.training.mismatch_kl_every
        if self.alg.bypass_mode:
            batch.old_log_probs = batch.rollout_log_probs.clone()
            if every and (self.global_step + 1) % every == 0:
                trainer_lp = self.backend.compute_log_probs(batch)
                m.update(fm.mismatch_metrics(batch.rollout_log_probs, trainer_lp, batch.loss_mask, batch.token_versions, self.current_param_version))
            return
        batch.old_log_probs = self.backend.compute_log_probs(batch)
        m.update(fm.mismatch_metrics(batch.rollout_log_probs, batch.old_log_probs, batch.loss_mask, batch.token_versions, self.current_param_version))
        level = self.alg.rollout_correction.level
        weights, is_metrics = algo.rollout_is_weights(
            batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, level=level, threshold=self.alg.rollout_correction.threshold
        )
        batch.is_weights = None if level == "none" else weights
        m.update(is_metrics)

    # ------------------------------------------------------------------ 4. reference
    @trace.traced("ref_log_prob")
    def _fit_compute_ref_log_prob(self, batch: TrainBatch) -> None:
        if self.backend.has_reference and self.alg.kl_coef > 0:
            batch.ref_log_probs = self.backend.compute_ref_log_probs(batch)

    # ------------------------------------------------------------------ 5. values
    @trace.traced("values")
    def _fit_compute_critic(self, batch: TrainBatch) -> None:
        if self.backend.has_critic:
            batch.values = self.backend.compute_values(batch)

    # ------------------------------------------------------------------ 6. advantages
    @trace.traced("advantage")
    def _fit_compute_advantage(self, batch: TrainBatch, m: dict[str, float]) -> None:
        mask = batch.loss_mask
        if self.alg.adv_estimator == "gae":
            if batch.values is None:
                raise RuntimeError("algorithm.adv_estimator=gae needs a critic (trainer.use_critic=true)")
            rewards = algo.token_rewards_from_scores(batch.scores, mask)
            adv, ret = algo.compute_gae(rewards, batch.values, mask, self.alg.gamma, self.alg.lam)
            batch.advantages = algo.masked_whiten(adv, mask) * mask
            batch.returns = ret
        else:
            batch.advantages = algo.compute_grpo_advantages(
                batch.scores, batch.group_index, mask, norm_by_std=self.alg.grpo_norm_by_std, run_index=batch.run_index
            )
        m["advantages/mean"] = float(algo.masked_mean(batch.advantages, mask))
        m["advantages/abs_mean"] = float(algo.masked_mean(batch.advantages.abs(), mask))

    # ------------------------------------------------------------------ 7./8. updates
    @trace.traced("update_critic")
    def _fit_update_critic(self, batch: TrainBatch, m: dict[str, float]) -> None:
        if self.backend.has_critic:
            batch.meta["num_mini_batches"] = self.cfg.async_training.require_batches
            m.update(self.backend.update_critic(batch))

    @trace.traced("update_actor")
    def _fit_update_actor(self, batch: TrainBatch, m: dict[str, float]) -> None:
        batch.meta["num_mini_batches"] = self.cfg.async_training.require_batches
        m.update(self.backend.update_actor(batch))

    # ------------------------------------------------------------------ 9. local step
    def _fit_update_local_step(self) -> None:
        self.local_trigger_step += 1

    # ------------------------------------------------------------------ 10. weights
    @trace.traced("update_weights")
    async def _fit_update_weights(self) -> dict[str, float]:
        if self.local_trigger_step < self.trigger:
            return {}
        self.local_trigger_step = 0
        self.current_param_version += 1
        return await self.synchronizer.update_weights(self.current_param_version)

    # ------------------------------------------------------------------ metrics
    def _staleness_metrics(self, batch: TrainBatch, samples: list[Sample], m: dict[str, float]) -> None:
        mask = batch.loss_mask > 0
        versions = batch.token_versions[mask]
        v = self.current_param_version
        if versions.numel():
            lag = v - versions
            m["staleness/min_token_version"] = float(versions.min())
            m["staleness/max_token_version"] = float(versions.max())
            m["staleness/token_mean"] = float(lag.float().mean())
            m["staleness/token_max"] = float(lag.max())
            for k, c in enumerate(torch.bincount(lag.clamp(min=0)).tolist()):
                if c:
                    m[f"staleness/token_hist/{k}"] = float(c)
        else:
            m["staleness/min_token_version"] = m["staleness/max_token_version"] = float(v)
        sample_lag = [v - s.min_version for s in samples if s.min_version >= 0]
        m["staleness/sample_max"] = float(max(sample_lag, default=0))
        m["staleness/stale_sample_ratio"] = sum(1 for x in sample_lag if x > 0) / max(len(samples), 1)
        m["staleness/sample_mean"] = sum(sample_lag) / len(sample_lag) if sample_lag else 0.0
        m.update(fm.histogram_metrics("staleness/sample_hist", sample_lag))
        spans = [s.max_version - s.min_version for s in samples]
        m["partial/partial_ratio"] = sum(1 for s in samples if s.num_aborts > 0) / max(len(samples), 1)
        m["partial/max_span"] = float(max(spans, default=0))
        m.update(fm.version_span_metrics(samples))
        m.update(fm.env_metrics(samples))
        with torch.no_grad():
            if batch.old_log_probs is not None and not self.alg.bypass_mode:
                diff = (batch.rollout_log_probs - batch.old_log_probs)[mask]
                m["mismatch/k1"] = float(diff.mean()) if diff.numel() else 0.0
                m["mismatch/abs_max"] = float(diff.abs().max()) if diff.numel() else 0.0
        for key, value in list(m.items()):
            if isinstance(value, float) and not math.isfinite(value):
                log.warning("metric %s is not finite at step %d", key, self.global_step + 1)

    def _throughput_metrics(self, batch: TrainBatch, samples: list[Sample], step_s: float, train_s: float, m: dict[str, float]) -> None:
        """This step's throughput (over the time since the previous step ended) and idle share."""
        step_s = max(step_s, 1e-9)
        # updating the engines' weights is trainer work; waiting for the Rollouter before it is not
        sync_busy = max(0.0, m.get("sync/total_s", 0.0) - m.get("sync/wait_rollouter_s", 0.0))
        self._busy_s += sync_busy
        self._samples_total += len(samples)
        m["perf/samples_per_s"] = len(samples) / step_s
        m["perf/trajectories_per_s"] = batch.batch_size / step_s
        m["perf/tokens_per_s"] = float(batch.num_tokens) / step_s
        m["perf/samples_per_s_avg"] = self._samples_total / max(time.monotonic() - self._start, 1e-9)
        m["trainer/idle_ratio_step"] = max(0.0, 1.0 - (train_s + sync_busy) / step_s)
        m.update(self._trainer_memory())

    def _trainer_memory(self) -> dict[str, float]:
        """Peak memory of the process that holds the model: the backend's ``peak_memory()``
        when it has one (a backend whose ranks are other processes answers for rank 0), else
        this process's."""
        fn = getattr(self.backend, "peak_memory", None)
        if callable(fn):
            try:
                out = fn()
                if isinstance(out, dict) and out:
                    return {f"memory/{k}": float(v) for k, v in out.items()}
            except Exception as e:  # noqa: BLE001 - a number for the trackers, never a failure
                log.debug("backend peak_memory failed: %r", e)
        return {f"memory/{k}": v for k, v in fm.peak_memory("trainer").items()}

    def _trace_train(self, batch: TrainBatch, samples: list[Sample], version: int, t_train: float, train_s: float) -> None:
        """Trace the samples taken (with their token versions) and the step's training block."""
        if not trace.enabled():
            return
        counts = fm.version_counts(batch.token_versions, batch.loss_mask, batch.group_index, len(samples))
        for s, c in zip(samples, counts):
            t_take = self._taken_at.pop(s.uid, time.time())
            trace.get().instant(
                "trainer.take", ts=t_take, uid=s.uid, version=version, min_version=min(c, default=-1),
                max_version=max(c, default=-1), aborts=s.num_aborts, tokens=sum(c.values()), token_versions=c,
            )
        trace.complete(
            "trainer.train", trace.wall(t_train), train_s, step=self.global_step + 1, version=version,
            local_step=self.local_trigger_step + 1, samples=len(samples), tokens=int(batch.num_tokens),
        )


async def _maybe_await(x: Any) -> Any:
    if asyncio.iscoroutine(x):
        return await x
    return x
