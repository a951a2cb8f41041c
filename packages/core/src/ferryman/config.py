"""Run configuration: pydantic models, YAML files, dotted command-line overrides.

Plugin sections (``engine``, ``trainer``, ``env``, ``router``, ``queue``, ``weight_sync``,
``trackers``) are chosen by their ``type`` field, which must be the name a plugin registered;
their remaining fields are validated by that plugin's own config class. Every error names the
field and, where the field has a fixed set of values, the allowed ones, before anything starts.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator



class SpecSource(Protocol):
    """What validating a plugin section needs from the plugin host (:class:`ferryman.plugins.PluginHost`
    is one; a protocol here keeps the import one-way: plugins -> specs -> config)."""

    def specs(self, role: str) -> dict[str, Any]: ...

    def disabled_provider(self, role: str, name: str) -> str | None: ...


class ConfigError(ValueError):
    """A configuration problem, reported before anything starts."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PluginConfig(Strict):
    """Base of every plugin's config class: ``type`` is the registered name."""

    type: str

    requires: ClassVar[dict[str, str]] = {}
    """Modules the implementation needs at run time but its config does not (a GPU stack
    installed as an extra), each with how to install it. ``ferryman train`` checks them before
    anything starts (:func:`missing_requirements`); ``ferryman config`` validates without them."""


def missing_requirements(plugin_cfgs: dict[str, Any]) -> list[str]:
    """One line per module that a chosen plugin ``requires`` and this environment lacks."""
    from importlib.util import find_spec

    out = []
    chosen = [(section, c) for section, v in plugin_cfgs.items() for c in (v if isinstance(v, (list, tuple)) else [v])]
    for section, cfg in chosen:
        for module, how in getattr(type(cfg), "requires", {}).items():
            try:
                found = find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(f"{section}.type {cfg.type!r} needs {module!r}, which is not installed: {how}")
    return out


TinyPreset = Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-1.7b"]
"""The names of ``ferryman.tiny.SHAPE_PRESETS`` (a test keeps the two in step)."""


class ModelConfig(Strict):
    path: str = "runs/tiny-model"
    """A transformers model directory (config, weights, tokenizer, chat template)."""
    build_tiny: bool = False
    """If the directory does not exist, build a tiny Qwen-style model there (random weights,
    locally trained tokenizer, chat template with tool calls)."""
    tiny_hidden_size: int = Field(64, gt=0)
    tiny_num_layers: int = Field(2, gt=0)
    tiny_vocab_size: int = Field(160, ge=107)
    """At least 107: the printable-ASCII byte alphabet plus special and tool-call tokens."""
    tiny_init_std: float = Field(0.02, gt=0)
    """Standard deviation of the random initial weights."""
    tiny_max_positions: int = Field(512, ge=16)
    """Context length of the tiny model (the transformers engine refuses longer prompts); with
    ``tiny_preset``, the preset's unless set."""
    tiny_preset: TinyPreset | None = None
    """Build the model with the shape of a released model (``ferryman.tiny.SHAPE_PRESETS``:
    hidden, MLP, heads, KV heads, rope base, tied embeddings of e.g. Qwen2.5-0.5B) and random
    weights; the vocabulary stays the tiny tokenizer's. ``tiny_num_layers``, when set, shrinks
    the layer count; ``tiny_hidden_size`` cannot be combined with it."""
    tiny_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the stored weights of a ``tiny_preset`` model."""

    @model_validator(mode="after")
    def preset_fixes_the_shape(self) -> ModelConfig:
        if self.tiny_preset is None:
            if self.tiny_dtype != "float32":
                raise ValueError("tiny_dtype: only a tiny_preset model is stored in another dtype than float32")
            return self
        # (a run directory's config.yaml from before the model section was written unset-free
        # holds the default hidden size: not a choice, so not refused)
        if "tiny_hidden_size" in self.model_fields_set and self.tiny_hidden_size != type(self).model_fields["tiny_hidden_size"].default:
            raise ValueError(f"tiny_hidden_size: tiny_preset {self.tiny_preset!r} fixes the hidden size; set only tiny_num_layers to shrink it")
        return self

    def tiny_build_kwargs(self, seed: int) -> dict[str, Any]:
        """Keyword arguments of :func:`ferryman.tiny.build_tiny_model` for this section."""
        kw: dict[str, Any] = dict(vocab_size=self.tiny_vocab_size, init_std=self.tiny_init_std, seed=seed)
        if self.tiny_preset is None:
            kw.update(hidden_size=self.tiny_hidden_size, num_layers=self.tiny_num_layers, max_positions=self.tiny_max_positions)
            return kw
        kw.update(preset=self.tiny_preset, dtype=self.tiny_dtype)
        if "tiny_num_layers" in self.model_fields_set:
            kw["num_layers"] = self.tiny_num_layers
        if "tiny_max_positions" in self.model_fields_set:
            kw["max_positions"] = self.tiny_max_positions
        return kw


class RunFailuresConfig(Strict):
    """When failing agent runs stop the whole run (``rollout.failures``). A failed run (the env
    raised, timed out, or returned a trajectory without a finite reward or with a non-finite
    log-prob) is counted and dropped; many of them in a row, or most of the recent ones, mean
    the env or the engines are broken, and the run stops with exit 1 and the first failure's
    traceback instead of retrying forever."""

    max_consecutive: int | None = Field(100, ge=1)
    """Stop after this many failed agent runs in a row (None: never)."""
    max_ratio: float | None = Field(0.9, gt=0, lt=1)
    """Stop when more than this share of the last ``window`` finished agent runs failed
    (checked once ``window`` runs have finished; None: never)."""
    window: int = Field(500, ge=10)
    """Finished agent runs the ratio is taken over."""
    log_first: int = Field(3, ge=0)
    """Failed runs logged one by one with their traceback; after them, one line at most every
    ``log_every_s`` with the count since the last line."""
    log_every_s: float = Field(30.0, gt=0)
    trace_max: int = Field(200, ge=0)
    """Failed runs (and samples dropped because all their runs failed) recorded in the trace;
    later ones are only counted (``rollouter/failed_trajectories``)."""


class RolloutConfig(Strict):
    n: int = Field(4, ge=1)
    """Trajectories per task (the GRPO group size)."""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    num_replicas: int = Field(1, ge=1)
    """Engine replicas (= rollout GPUs / tensor parallel size)."""
    num_gpus_per_replica: float = Field(0.0, ge=0.0)
    """GPUs each engine replica's Ray actor reserves (e.g. the tensor-parallel size for vLLM);
    0 for CPU engines. A fraction below 1 shares a GPU (with other replicas, or with the
    Trainer: ``ray.trainer.num_gpus``); above 1 it must be a whole number (Ray's rule)."""

    @field_validator("num_gpus_per_replica")
    @classmethod
    def _ray_gpu_amount(cls, v: float) -> float:
        return check_gpu_amount(v)
    max_concurrency_per_replica: int = Field(16, ge=1)
    """Trajectories each replica serves at once (VeRL's ``concurrent_samples_per_replica``)."""
    total_rollout_steps: int | None = Field(None, ge=1)
    """Stop admitting tasks after this many samples (default: unlimited)."""
    run_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit of one agent run; a run over it is cancelled, counted
    (``rollouter/timed_out_trajectories``) and dropped like a failed run. None: no limit."""
    failures: RunFailuresConfig = Field(default_factory=RunFailuresConfig)
    """When failing agent runs stop the run (see :class:`RunFailuresConfig`)."""


class AsyncTrainingConfig(Strict):
    """The three knobs (plus ``require_batches``) that select modes (a)–(d)."""

    trigger_parameter_sync_step: int = Field(1, ge=1)
    """Local trainer steps between two weight syncs."""
    staleness_threshold: float = Field(0.0, ge=0.0)
    """Extra share of samples the Rollouter may produce ahead of the trainer per window."""
    partial_rollout: bool = False
    """Abort in-flight generation at a sync and resume it afterwards (needs staleness > 0)."""
    require_batches: int = Field(1, ge=1)
    """Mini-batches gathered for one local step."""
    colocated: bool = False
    """Generation and training take turns on the same resources: the Rollouter generates a
    whole window (``trigger × require_batches × ppo_mini_batch_size`` samples), the engines
    sleep (pause, release KV cache), the Trainer trains the window's local steps, and the weight
    sync wakes the engines with the new weights. Needs ``staleness_threshold=0``."""

    @model_validator(mode="after")
    def partial_rollout_needs_staleness(self) -> AsyncTrainingConfig:
        if self.partial_rollout and self.staleness_threshold == 0:
            raise ValueError(
                "partial_rollout=True with staleness_threshold=0 is meaningless: a window admits "
                "no sample that spans two versions; set staleness_threshold > 0 or turn "
                "partial_rollout off"
            )
        return self

    @model_validator(mode="after")
    def colocated_takes_turns(self) -> AsyncTrainingConfig:
        if self.colocated and (self.staleness_threshold != 0 or self.partial_rollout):
            raise ValueError(
                "colocated=True: generation and training take turns, so no sample can be stale; "
                "set staleness_threshold=0 and partial_rollout=false"
            )
        return self

    @property
    def mode(self) -> str:
        if self.colocated:
            return "colocated"
        if self.staleness_threshold == 0:
            return "a" if self.trigger_parameter_sync_step == 1 else "b"
        return "d" if self.partial_rollout else "c"


class RolloutCorrectionConfig(Strict):
    level: Literal["none", "token", "sequence"] = "token"
    """Rollout importance-sampling correction when ``bypass_mode`` is off."""
    threshold: float = Field(2.0, gt=0)
    """Upper truncation of the IS weight."""


class AlgorithmConfig(Strict):
    adv_estimator: Literal["grpo", "gae"] = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    grpo_norm_by_std: bool = True
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    """Set above ``clip_ratio_low`` for DAPO's clip-higher."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    entropy_coeff: float = 0.0
    kl_coef: float = Field(0.0, ge=0)
    """KL-to-reference loss coefficient (0 turns the reference model off)."""
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    value_clip: float = Field(0.5, gt=0)
    bypass_mode: bool = True
    """old_log_prob = rollout log-prob (no recompute). Off: recompute with the trainer and
    apply rollout importance-sampling correction."""
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)


class TrainerLoopConfig(Strict):
    ppo_mini_batch_size: int = Field(4, ge=1)
    """Samples (tasks, each with ``rollout.n`` trajectories) per mini-batch."""
    total_steps: int = Field(50, ge=1)
    """Local trainer steps to run."""
    weight_bucket_megabytes: float = Field(64, gt=0)
    mismatch_kl_every: int = Field(0, ge=0)
    """With ``algorithm.bypass_mode`` on, recompute the trainer's log-probs every this many
    steps to report the rollout-vs-trainer mismatch (``mismatch/kl_*``); 0: never (one extra
    forward pass when on). Without bypass the recomputed log-probs are used at every step."""
    weight_sync_attempts: int = Field(3, ge=1)
    """Tries of one weight transfer before the sync (and the run) fails; engines stay paused
    between tries, so none generates from a half-loaded model."""
    max_nonfinite_grad_steps: int = Field(5, ge=1)
    """Stop the run (exit 1) after this many trainer steps in a row whose gradient norm
    (``actor/grad_norm``, ``critic/grad_norm``) is not finite: the backend skipped their update,
    so the run trains nothing. A run whose every step was skipped fails at its end as well."""


class TraceConfig(Strict):
    level: Literal["off", "basic", "detail"] = "basic"
    """``basic``: what ``ferryman timeline`` and the trace metrics need (a few records per sample
    and per trainer step); ``detail``: also one span per engine call; ``off``: no trace."""

    @field_validator("level", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML (and so a `trace.level=off` override) reads a bare off/no as false
        return "off" if v is False else v


class CheckpointConfig(Strict):
    """Checkpoints of the whole pipeline (see :mod:`ferryman.checkpoint`)."""

    every_steps: int = Field(0, ge=0)
    """Save after every this many trainer steps (0: only on SIGTERM). Must be a multiple of
    ``async_training.trigger_parameter_sync_step``: a checkpoint is cut at a weight sync."""
    keep: int = Field(2, ge=1)
    """Newest checkpoints kept; older ones are deleted after a new one is in place."""
    dir: str | None = None
    """Where checkpoints go (default: ``RUN_DIR/checkpoints``)."""
    on_sigterm: bool = True
    """On SIGTERM, save a checkpoint at the next sync boundary and stop (exit code 75)."""


PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RolePlacementConfig(Strict):
    """What one role's Ray actor (or placement-group bundle) reserves, and where it may go."""

    num_cpus: float = Field(0.0, ge=0.0)
    """CPUs reserved (logical Ray CPUs)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, e.g. ``{rollout_node: 1}`` for nodes started with
    ``ray start --resources='{"rollout_node": 8}'``."""
    accelerator_type: str | None = None
    """Only nodes of this accelerator type (Ray's ``accelerator_type:<T>`` node resource, e.g.
    ``H100``, ``A100``)."""

    @field_validator("resources")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r}: give CPUs as num_cpus and GPUs as rollout.num_gpus_per_replica / num_gpus, not as a custom resource")
            if amount <= 0:
                raise ValueError(f"{name!r}: amount must be > 0, got {amount}")
        return v


class EnginePlacementConfig(RolePlacementConfig):
    """Each engine replica's bundle: these CPUs and resources plus its GPUs
    (``rollout.num_gpus_per_replica``). A bundle that asks for nothing (CPU engines with the
    defaults) is no placement group: the replicas go where Ray puts them, as on a laptop."""


class TrainerPlacementConfig(RolePlacementConfig):
    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs the trainer's actor reserves (a trainer plugin that starts rank actors of its own,
    such as FSDP with ``num_workers > 1``, reserves theirs itself). A fraction below 1 shares
    the GPU with engine replicas (``rollout.num_gpus_per_replica``), e.g. the vLLM engine and the
    FSDP trainer on one H200 with ``weight_sync: {type: cuda_ipc}``; above 1 it must be whole."""

    @field_validator("num_gpus")
    @classmethod
    def _gpu_amount(cls, v: float) -> float:
        return check_gpu_amount(v)


class RayConfig(Strict):
    """Where the Ray actors run: a local Ray started for the run, or an existing cluster."""

    address: str | None = None
    """``null``: ``$RAY_ADDRESS`` if set (``ray job submit`` sets it), else a local Ray started
    for this run (sized by ``ray_num_cpus``). ``auto``: the cluster this machine belongs to.
    ``HOST:PORT`` (the GCS) or ``ray://HOST:10001`` (Ray Client). An existing cluster is joined
    as it is: no resource arguments are passed."""
    namespace: str | None = None
    """Ray namespace of the run's actors (``null``: an anonymous one)."""
    placement_strategy: PlacementStrategy = "PACK"
    """Strategy of the engine replicas' placement group (one bundle per replica, so a replica's
    GPUs, tensor parallel included, are always on one node). ``PACK``: as few nodes as possible;
    ``SPREAD``: over as many nodes as possible; ``STRICT_*``: the same, or fail."""
    engine: EnginePlacementConfig = Field(default_factory=EnginePlacementConfig)
    trainer: TrainerPlacementConfig = Field(default_factory=TrainerPlacementConfig)
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for a placement group that fits the cluster but whose resources are
    held by other jobs; then the run stops with what was pending."""
    control_on_driver_node: bool = True
    """Keep the Rollouter and the MessageQueue on the driver's node (the head node under
    ``ray job submit``), so that losing a worker node never takes the control plane."""

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty; use null (local Ray or $RAY_ADDRESS), 'auto', 'HOST:PORT' or 'ray://HOST:10001'")
        return v


class ValidationConfig(Strict):
    """Evaluation on held-out tasks during training (and for ``ferryman eval``), through the same
    engines and env; never queued, never trained on, outside the staleness quota."""

    every_steps: int = Field(0, ge=0)
    """Validate after every this many trainer steps (0: never during training)."""
    before_train: bool = False
    """Also validate before the first step (at weight version 0; not after a resume)."""
    n: int = Field(1, ge=1)
    """Answers per task: pass@1 is their mean success, pass@n the chance that one of n passes."""
    temperature: float | None = Field(None, ge=0.0)
    """Sampling temperature (default: ``rollout.temperature``)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    """Per generation (default: ``rollout.max_tokens``)."""
    env: dict[str, Any] | None = Field(None, validation_alias=AliasChoices("env", "tasks"))
    """The held-out tasks (also spelled ``tasks``): fields that replace the ``env`` section's
    (e.g. ``{path: val.jsonl}`` for the dataset env, ``{num_tasks: 50}`` for digits); the
    validation env is built from the merged section with seed ``seed + 1``."""
    split: float | None = Field(None, gt=0.0, lt=1.0)
    """Or: hold out this share of the env's tasks (the last ones) from training and validate on
    them."""
    num_tasks: int | None = Field(None, ge=1)
    """Validate on at most this many tasks (the first ones)."""
    success_threshold: float = 1.0
    """A run passes when its reward is at least this."""
    concurrency: int = Field(64, ge=1)
    """Validation runs in flight at once."""

    @model_validator(mode="after")
    def one_task_source(self) -> ValidationConfig:
        if self.env is not None and self.split is not None:
            raise ValueError("validation: give env (held-out tasks) or split (a share of the env's tasks), not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.before_train


class RunConfig(Strict):
    """The whole run."""

    seed: int = 0
    run_dir: str = "runs/default"
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    training: TrainerLoopConfig = Field(default_factory=TrainerLoopConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    """Evaluation on held-out tasks (see :mod:`ferryman.evaluation`)."""
    env: dict[str, Any] = Field(default_factory=lambda: {"type": "digits"})
    engine: dict[str, Any] = Field(default_factory=lambda: {"type": "hf"})
    trainer: dict[str, Any] = Field(default_factory=lambda: {"type": "fsdp"})
    router: dict[str, Any] = Field(default_factory=lambda: {"type": "local"})
    queue: dict[str, Any] = Field(default_factory=lambda: {"type": "ray"})
    weight_sync: dict[str, Any] = Field(default_factory=lambda: {"type": "object_store"})
    trackers: list[dict[str, Any]] = Field(default_factory=lambda: [{"type": "jsonl"}])
    runtime: Literal["ray", "inline"] = "ray"
    """``ray``: Rollouter, MessageQueue, engines and Trainer are Ray actors (local Ray on a laptop).
    ``inline``: all of them on one asyncio loop in this process (tests, debugging); the queue is
    then always the in-process ``local`` queue, whatever ``queue.type`` says (logged)."""
    ray_num_cpus: int | None = None
    """CPUs of the local Ray started for a run (default: this machine's, or what the run's
    placement needs if more). Ignored when joining a cluster (``ray.address``)."""
    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs the local Ray instance has (default: those Ray detects). When set, the GPU shares of
    the engine replicas and the Trainer (``ray.trainer.num_gpus``) must fit them (checked here, before anything starts)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray cluster and placement (``runtime: ray``); see docs/cluster.md."""
    engine_threads: int = Field(1, ge=1)
    """torch threads per engine replica."""
    trainer_threads: int = Field(1, ge=1)
    """torch threads of the trainer process."""
    log_every: int = Field(1, ge=1)
    trace: TraceConfig = Field(default_factory=TraceConfig)
    """The event trace in ``RUN_DIR/trace/`` (see :mod:`ferryman.trace`)."""

    @model_validator(mode="after")
    def gpu_shares_fit(self) -> RunConfig:
        if self.ray_num_gpus is None:
            return self
        demands = [("rollout.num_gpus_per_replica", self.rollout.num_gpus_per_replica)] * self.rollout.num_replicas
        demands.append(("ray.trainer.num_gpus", self.ray.trainer.num_gpus))
        problem = pack_gpus([d for _, d in demands], self.ray_num_gpus)
        if problem:
            asked = f"{self.rollout.num_replicas} x rollout.num_gpus_per_replica={self.rollout.num_gpus_per_replica:g} + ray.trainer.num_gpus={self.ray.trainer.num_gpus:g}"
            raise ValueError(f"rollout.num_gpus_per_replica / ray.trainer.num_gpus: {asked} do not fit ray_num_gpus={self.ray_num_gpus} ({problem})")
        return self

    @model_validator(mode="after")
    def checkpoints_at_sync_boundaries(self) -> RunConfig:
        trigger = self.async_training.trigger_parameter_sync_step
        if self.checkpoint.every_steps % trigger:
            raise ValueError(
                f"checkpoint.every_steps: {self.checkpoint.every_steps} is not a multiple of "
                f"async_training.trigger_parameter_sync_step ({trigger}); a checkpoint is taken at a "
                "weight sync, where engines and trainer hold the same weights"
            )
        return self

    # ---- derived numbers (seed §07 funnel, §06 quota) ----
    @property
    def required_samples(self) -> int:
        """Samples one local step consumes: ``require_batches × ppo_mini_batch_size``."""
        return self.async_training.require_batches * self.training.ppo_mini_batch_size

    def funnel(self) -> dict[str, int]:
        return compute_funnel(
            ppo_mini_batch_size=self.training.ppo_mini_batch_size,
            staleness_threshold=self.async_training.staleness_threshold,
            require_batches=self.async_training.require_batches,
            trigger_parameter_sync_step=self.async_training.trigger_parameter_sync_step,
            num_replicas=self.rollout.num_replicas,
            max_concurrency_per_replica=self.rollout.max_concurrency_per_replica,
        )


def check_gpu_amount(v: float) -> float:
    """Ray's rule for a GPU request: a fraction below 1 (a share of one GPU) or a whole number."""
    if v > 1 and v != int(v):
        raise ValueError(f"{v:g} GPUs: a request above 1 must be a whole number of GPUs (a fraction shares one GPU only)")
    return v


def pack_gpus(demands: list[float], num_gpus: int) -> str | None:
    """Whether Ray can place actors asking for ``demands`` GPUs each on ``num_gpus`` GPUs: whole
    requests take whole GPUs, fractions share a GPU up to 1 (placed first-fit, largest first,
    as Ray packs fractions onto the fullest GPU that still has room). Returns what does not fit,
    or None."""
    whole = sum(int(d) for d in demands if d >= 1)
    if whole > num_gpus:
        return f"the whole-GPU requests alone take {whole}"
    free = [1.0] * (num_gpus - whole)
    for d in sorted((d for d in demands if 0 < d < 1), reverse=True):
        fits = [i for i, f in enumerate(free) if f + 1e-9 >= d]
        if not fits:
            total = sum(d for d in demands if 0 < d < 1)
            return f"the shares below 1 add up to {total:g} and cannot be packed onto the {len(free) or 'no'} GPU(s) left"
        best = min(fits, key=lambda i: free[i])
        free[best] -= d
    return None


def compute_funnel(
    *,
    ppo_mini_batch_size: int,
    staleness_threshold: float,
    require_batches: int,
    trigger_parameter_sync_step: int,
    num_replicas: int,
    max_concurrency_per_replica: int,
) -> dict[str, int]:
    """The concurrency funnel of seed §07.

    ``window_samples`` = samples the trainer consumes between two syncs; ``max_required_samples``
    = what the Rollouter may produce in one window, ``(1 + staleness) × window_samples``.
    """
    window = trigger_parameter_sync_step * require_batches * ppo_mini_batch_size
    max_required = int(math.floor((1 + staleness_threshold) * window + 1e-9))
    max_concurrent = min(num_replicas * max_concurrency_per_replica, max_required)
    return {
        "window_samples": window,
        "max_required_samples": max_required,
        "num_replicas": num_replicas,
        "max_concurrent_samples": max_concurrent,
        "max_queue_size": max_required,
    }


# --------------------------------------------------------------------------- loading


def _parse_scalar(text: str) -> Any:
    """Parse an override value as YAML (``1`` → int, ``true`` → bool, ``[1,2]`` → list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place; returned for chaining)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. async_training.staleness_threshold=0.5")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                path = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {path} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return data


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) model that holds the field at ``loc``."""
    cls: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list
        field = cls.model_fields.get(part) if cls is not None else None
        ann = field.annotation if field is not None else None
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if cls is None:
            return []
    return list(cls.model_fields) if cls is not None else []


def _format_validation_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(e["loc"]) if p != "")
        msg = e["msg"]
        ctx = e.get("ctx") or {}
        if e["type"] == "literal_error" and "expected" in ctx:
            msg = f"{msg} (allowed: {ctx['expected']})"
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + (_did_you_mean(e["loc"][-1], _fields_at(model, tuple(e["loc"]))) if e["loc"] else "")
        lines.append(f"  {loc or '<root>'}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    host: SpecSource | None = None,
) -> tuple[RunConfig, dict[str, Any]]:
    """Read YAML, apply overrides, validate the core sections and every plugin section.

    Returns the RunConfig and the validated plugin configs by section name (``"trackers"`` maps
    to a list). Raises ConfigError naming the field.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
        data = loaded
    # plugin sections start from their defaults so that `env.num_tasks=5` keeps `type`
    for name, fld in RunConfig.model_fields.items():
        if name in ROLE_OF_SECTION and name not in data and fld.default_factory is not None:
            data[name] = fld.default_factory()
    apply_overrides(data, overrides or [])
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, model=RunConfig)) from None
    plugin_cfgs = validate_plugin_sections(cfg, host) if host is not None else {}
    return cfg, plugin_cfgs


ROLE_OF_SECTION = {
    "engine": "engine",
    "trainer": "trainer",
    "env": "env",
    "router": "router",
    "queue": "queue",
    "weight_sync": "weight_sync",
}


def validate_plugin_section(host: SpecSource, role: str, section: str, raw: Any) -> PluginConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a mapping with a 'type' field")
    specs = host.specs(role)
    allowed = ", ".join(sorted(specs)) or "(none installed)"
    name = raw.get("type")
    if name is None:
        raise ConfigError(f"{section}.type: missing (allowed: {allowed})")
    if name not in specs:
        disabled = host.disabled_provider(role, name) if isinstance(name, str) else None
        if disabled is not None:
            raise ConfigError(f"{section}.type: {role} {name!r} is registered by {disabled} (allowed now: {allowed})")
        raise ConfigError(f"{section}.type: unknown {role} {name!r}{_did_you_mean(name, specs)} (allowed: {allowed})")
    cls = specs[name].config_cls
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, section, cls)) from None


def validate_plugin_sections(cfg: RunConfig, host: SpecSource) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, role in ROLE_OF_SECTION.items():
        out[section] = validate_plugin_section(host, role, section, getattr(cfg, section))
    out["trackers"] = [
        validate_plugin_section(host, "tracker", f"trackers.{i}", t) for i, t in enumerate(cfg.trackers)
    ]
    if cfg.validation.env is not None:
        out["validation_env"] = validate_plugin_section(host, "env", "validation.env", {**cfg.env, **cfg.validation.env})
    return out
