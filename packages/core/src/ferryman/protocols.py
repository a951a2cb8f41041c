"""The role protocols. Every plugin implements one of these; ``ferryman.testing`` checks it.

Engines, queues, routers and envs are ``async``: they live on an asyncio event loop (inside Ray
actors in a run, or in a test's loop). Trainer backends are synchronous: a training step is
compute-bound and runs on its own process (or ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ferryman.types import Sample, SamplingParams, TokenOutput, Trajectory

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ferryman.batch import TrainBatch

NamedTensors = list[tuple[str, "torch.Tensor"]]
"""One bucket of full (unsharded) tensors, by parameter name."""


@runtime_checkable
class Engine(Protocol):
    """A rollout engine replica: generates token ids with log-probs for token-id prompts.

    Lifecycle: ``start()`` once, then any number of concurrent ``generate()`` calls. A weight
    update is ``pause(abort=...)`` → ``release_kv_cache()`` → ``load_weights()`` per bucket →
    ``set_version()`` → ``resume_kv_cache()`` → ``resume()``.
    """

    async def start(self) -> None: ...

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> TokenOutput:
        """Generate a continuation. Returns ``stop_reason`` ``"stop"`` (EOS or a stop token,
        which is included), ``"length"`` (budget used) or ``"aborted"`` (``pause(abort=True)``
        was called while it ran; the tokens produced so far are returned). A call that arrives
        while the engine is paused waits for ``resume()``.

        Optional: an engine that can stream also accepts a keyword ``on_tokens`` and delivers
        tokens through it as it makes them (:mod:`ferryman.streaming`)."""
        ...

    async def pause(self, abort: bool) -> None:
        """Stop starting new generation steps. ``abort=True``: in-flight requests return now
        with ``stop_reason="aborted"``. ``abort=False``: wait until in-flight requests finish."""
        ...

    async def resume(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def load_weights(self, named_tensors: NamedTensors) -> None:
        """Load one bucket of full tensors (names as in the trainer's state dict). The tensors
        may be views of a transport's receive buffer that is reused once this returns: copy
        them (into the model's parameters), do not keep them."""
        ...

    async def set_version(self, version: int) -> None:
        """Finish a weight update: tokens generated from now on carry ``version``."""
        ...

    async def get_version(self) -> int: ...

    async def stats(self) -> dict[str, float]:
        """Counters: in-flight requests, generated tokens, prefix-cache hits, aborts, …"""
        ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class Queue(Protocol):
    """A bounded FIFO of Samples between the Rollouter and the Trainer."""

    async def put(self, sample: Sample) -> bool:
        """Append; waits while full. Returns False (and keeps nothing) once closed."""
        ...

    async def get(self, timeout: float | None = None) -> Sample | None:
        """Remove the oldest sample; waits while empty. ``None`` when closed and drained, or
        on timeout."""
        ...

    async def qsize(self) -> int: ...

    async def close(self) -> None: ...

    async def snapshot(self) -> list[Sample]:
        """The queued samples, oldest first, without removing them (for checkpoints)."""
        ...

    async def stats(self) -> dict[str, float]: ...


@runtime_checkable
class Router(Protocol):
    """Chooses the engine replica for each request of a trajectory (sticky per request id)."""

    async def acquire(self, request_id: str) -> str:
        """The replica name to send this request to; counts it as in flight."""
        ...

    async def release(self, request_id: str, replica: str) -> None:
        """The request finished (in any way) on ``replica``."""
        ...

    async def add_replica(self, replica: str) -> None: ...

    async def remove_replica(self, replica: str) -> None: ...

    async def report_failure(self, replica: str, error: str) -> None:
        """The replica errored; stop routing new work to it."""
        ...

    async def stats(self) -> dict[str, float]: ...


class GenerateClient(Protocol):
    """What an env uses to generate: the server client (routing, partial-rollout resume)."""

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> TokenOutput: ...


@runtime_checkable
class Env(Protocol):
    """An agent environment: a dataset of tasks and one agent run per call to ``run``.

    Optional methods the Rollouter uses when present: ``stats() -> dict[str, float]`` (merged
    into the Rollouter's stats, so it reaches the trackers) and ``async aclose()`` (awaited by
    ``Rollouter.stop``, to release servers, sandboxes, temporary files).

    Optional class attribute ``resumable: bool`` (default False): True when a run is a
    deterministic function of its task and the outputs ``client.generate`` returns, with no state
    outside (a white-box agent loop). A run cut by a checkpoint is then replayed from its record
    and continues where it stopped; other envs' runs are re-dispatched from the start (see
    :mod:`ferryman.replay`).
    """

    def num_tasks(self) -> int:
        """Number of tasks in the training set (the Rollouter cycles through them)."""
        ...

    def get_task(self, index: int) -> dict[str, Any]:
        """The task at ``index`` (JSON-serialisable)."""
        ...

    async def run(
        self,
        task: dict[str, Any],
        request_id: str,
        client: GenerateClient,
        params: SamplingParams,
    ) -> Trajectory | list[Trajectory]:
        """Run the agent on ``task`` and return its scored trajectory (``reward`` set), or the
        run's segments in order (e.g. a black-box agent that rewrote its history part-way; each
        segment carries the run's reward and becomes its own row in training, and the segments
        count as one run: the Rollouter sets their ``run_id``, see ``TrainBatch.run_index``).
        Raise to signal a failed run; the Rollouter counts it and drops the trajectory."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves full weights from the trainer to every engine replica (the transport)."""

    async def transfer(
        self, buckets: Iterator[NamedTensors], engines: Sequence[Any], version: int
    ) -> dict[str, float]:
        """Send every bucket to every engine (``engines`` are engine handles with the Engine
        methods, awaited), so each ends up with identical weights. Returns timing/size metrics.
        Engines are already paused; the caller sets the version and resumes them.

        A transport may also have ``close()`` (core calls it when the run ends) and may set up
        an engine-side receiver through ``engine.attach_weight_receiver`` (see
        :class:`ferryman.engine_host.EngineHandle`)."""
        ...


@runtime_checkable
class TrainerBackend(Protocol):
    """A training backend: policy (actor), optional critic and frozen reference."""

    has_critic: bool
    has_reference: bool

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """Actor log-probs, [B, T], aligned with ``batch.input_ids`` (position t scores token
        t given tokens < t; position 0 is 0)."""
        ...

    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor: ...

    def compute_values(self, batch: TrainBatch) -> torch.Tensor: ...

    def update_critic(self, batch: TrainBatch) -> dict[str, float]: ...

    def update_actor(self, batch: TrainBatch) -> dict[str, float]: ...

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Full tensors of the actor, gathered per parameter, grouped in buckets of at most
        ``bucket_bytes`` (a larger tensor forms a bucket alone), on the CPU.

        A backend may also take a keyword ``device``: with ``device="cuda"`` (asked by the
        weight sync when its transport's buffers are on the GPU: the transport's
        ``source_device``) it may leave the tensors on its own accelerator, valid until its
        next update; the transport then packs them there without a round trip through host
        memory. A backend without the keyword is always asked for CPU tensors."""
        ...

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """The complete training state in memory (models, optimizers, schedulers, RNG, counters).

        A backend may also offer ``save_checkpoint(path: str)`` / ``load_checkpoint(path: str)``
        (write/read that state under a directory, e.g. sharded with torch distributed
        checkpointing); run checkpoints use them when present, else ``torch.save`` of this.

        Colocated mode (``async_training.colocated``) also uses two optional methods when a
        backend has them: ``offload()`` frees the accelerator (parameters and optimizer states
        to host memory) once the weights went out, so the engines can generate in that memory,
        and ``onload()`` brings them back after the engines went to sleep. A backend must
        onload by itself if any other method is called while offloaded."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Tracker(Protocol):
    """A metric sink."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...
