"""Data types that cross process edges: sampling parameters, engine output, trajectories, samples.

Everything here is a plain dataclass of Python lists and numbers so that it pickles cheaply
through Ray and serialises to JSON for checkpoints and traces.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Literal

StopReason = Literal["stop", "length", "aborted"]


def new_id(prefix: str = "") -> str:
    """An unguessable id (128 random bits), optionally prefixed."""
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass
class SamplingParams:
    """How one ``generate()`` call samples.

    ``max_tokens`` is the budget of *this* call; the server client shrinks it across
    partial-rollout resumes so that the merged answer never exceeds the original budget.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def replace(self, **changes: Any) -> SamplingParams:
        # a shallow copy with its own stop list (``asdict`` deep-copies through every field:
        # a hot path, once per generate call)
        out = copy.copy(self)
        for k, v in changes.items():
            if k not in _SAMPLING_FIELDS:
                raise TypeError(f"SamplingParams.replace: unknown field {k!r}")
            setattr(out, k, v)
        if "stop_token_ids" not in changes:
            out.stop_token_ids = list(self.stop_token_ids)
        return out


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass
class TokenOutput:
    """What an engine (and the server client) returns for one generation.

    ``versions[i]`` is the weight version that produced ``token_ids[i]``; ``log_probs[i]`` is
    the log-probability of that token under the sampling distribution of that version
    (temperature applied, before top-p/top-k truncation).
    """

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    routed_experts: list[Any] | None = None
    """MoE models, when the engine reports it: the experts each position was routed to,
    ``[positions][layers][top-k]`` (ints; ``layers`` as the engine counts them, vLLM and SGLang:
    the model's ``num_hidden_layers``). Position ``i`` is token ``i`` of the sequence the engine
    ran for THIS call: the call's ``prompt_ids`` followed by ``token_ids``, from position 0. The
    engine runs a forward on every token but the last generated one, so a complete list has
    ``len(prompt_ids) + len(token_ids) - 1`` entries; it may be shorter (positions past its end
    were not reported), never longer. A call that resumes an earlier one (the server client,
    :mod:`ferryman.replay`) sends the earlier tokens as part of its prompt, so its list covers
    them too and SUPERSEDES the earlier list instead of extending it; a streamed delta's list,
    when set, likewise covers everything so far. ``None``: not reported."""
    num_cached_prompt_tokens: int = 0
    replica: str | None = None
    num_aborts: int = 0
    """How many times this generation was aborted and resumed (partial rollout)."""

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.log_probs) == len(self.versions)):
            raise ValueError(
                "TokenOutput: token_ids, log_probs and versions must have equal lengths, got "
                f"{len(self.token_ids)}, {len(self.log_probs)}, {len(self.versions)}"
            )


@dataclass
class Trajectory:
    """One agent run: a prompt and a response made of model tokens and observation tokens.

    ``response_ids`` holds everything after the first prompt: model tokens (mask 1) and tokens
    the policy did not produce, such as tool output or chat-template glue (mask 0).
    ``rollout_log_probs`` and ``token_versions`` are aligned with ``response_ids``; entries at
    mask-0 positions are 0.0 and -1.
    """

    request_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_aborts: int = 0
    stop_reason: str = "stop"
    extra: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    """The agent run this trajectory belongs to. Set by the Rollouter (the run's request id) on
    every trajectory an ``Env.run`` returns; the segments of one run share it, and training
    counts them as one run (``TrainBatch.run_index``)."""

    def append_model_tokens(self, out: TokenOutput) -> None:
        """Append a generation: mask 1, its log-probs and versions.

        With ``out.routed_experts`` it also becomes ``extra["routed_experts"]`` (the routing of
        ``prompt_ids + response_ids`` from position 0, see :attr:`TokenOutput.routed_experts`):
        right when the generation's prompt was this trajectory's tokens so far, as in the usual
        multi-turn loop. A list longer than the trajectory cannot be its routing and is dropped
        (with any earlier one); a generation without routing leaves the earlier list, which
        then covers only a prefix."""
        self.response_ids.extend(out.token_ids)
        self.response_mask.extend([1] * len(out.token_ids))
        self.rollout_log_probs.extend(out.log_probs)
        self.token_versions.extend(out.versions)
        self.num_aborts += out.num_aborts
        self.stop_reason = out.stop_reason
        if out.routed_experts is not None:
            if len(out.routed_experts) <= len(self.prompt_ids) + len(self.response_ids):
                self.extra["routed_experts"] = list(out.routed_experts)
            else:
                self.extra.pop("routed_experts", None)

    def append_observation(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not produce (tool output, template glue): mask 0."""
        self.response_ids.extend(token_ids)
        self.response_mask.extend([0] * len(token_ids))
        self.rollout_log_probs.extend([0.0] * len(token_ids))
        self.token_versions.extend([-1] * len(token_ids))

    @property
    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.token_versions, self.response_mask) if m]

    @property
    def min_version(self) -> int:
        vs = self.model_versions
        return min(vs) if vs else -1

    @property
    def max_version(self) -> int:
        vs = self.model_versions
        return max(vs) if vs else -1

    def validate(self) -> None:
        n = len(self.response_ids)
        for name in ("response_mask", "rollout_log_probs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory {self.request_id}: {name} has {len(getattr(self, name))} "
                    f"entries, response_ids has {n}"
                )
        if not self.prompt_ids:
            raise ValueError(f"Trajectory {self.request_id}: empty prompt_ids")


@dataclass
class Sample:
    """The unit the Rollouter produces and the MessageQueue carries: one task (prompt) and its
    ``rollout.n`` trajectories (a GRPO group). ``ppo_mini_batch_size`` counts Samples.
    """

    uid: str
    task_index: int
    trajectories: list[Trajectory]
    created_version: int = 0
    """Rollouter's weight version when the sample was admitted."""
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: int = 0
    """Trajectories of this group that failed and were dropped."""

    @property
    def min_version(self) -> int:
        vs = [t.min_version for t in self.trajectories if t.min_version >= 0]
        return min(vs) if vs else -1

    @property
    def max_version(self) -> int:
        return max((t.max_version for t in self.trajectories), default=-1)

    @property
    def num_aborts(self) -> int:
        return sum(t.num_aborts for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.response_ids) for t in self.trajectories)
