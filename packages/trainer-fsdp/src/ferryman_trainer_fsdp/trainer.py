"""The FSDP2 trainer backend: actor, optional critic and frozen reference, sharded with
``torch.distributed.fsdp.fully_shard``.

Execution model
---------------
The backend is SPMD: every rank of the process group constructs one backend and every rank
calls the same methods with the *same* :class:`~ferryman.batch.TrainBatch`. Internally the rows
are split across ranks (data parallel, rank ``r`` takes rows ``r, r + world, …``), the results
of the no-grad passes are summed back so that every rank returns the full ``[B, T]`` tensor, and
the number of micro-batches is equalised across ranks (a rank with fewer runs zero-weight dummy
micro-batches) so that FSDP's collectives always line up. With one process (the default on CPU)
all of this reduces to plain single-process training.

Token alignment follows :mod:`ferryman.batch`: position ``t`` of a log-prob describes token
``t`` given tokens ``< t``, so the model's output at ``t - 1`` scores token ``t`` and position 0
is 0. Values use the same alignment: ``values[t]`` is the critic's estimate computed from the
hidden state at ``t - 1``, i.e. the value of the state in which token ``t`` is chosen. Padding
positions of every returned ``[B, T]`` tensor are 0. If ``batch.meta["temperature"]`` is set,
logits are divided by it before log-probs and entropies (to match an engine that samples with
that temperature); the default is 1.

Batch meta keys read: ``num_mini_batches`` (``update_actor``/``update_critic``: optimizer steps
per epoch; rows of one GRPO group stay in one mini-batch) and ``temperature``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field, field_validator

from ferryman.algorithms import (
    actor_objective,
    agg_units,
    entropy_from_logits,
    lean_entropy_from_logits,
    lean_log_probs_from_logits,
    value_loss,
)
from ferryman.batch import TrainBatch, split_groups
from ferryman.cluster.connect import free_port
from ferryman.config import AlgorithmConfig, PluginConfig
from ferryman.protocols import NamedTensors

log = logging.getLogger(__name__)

__all__ = ["FSDPTrainerConfig", "FSDPTrainerBackend", "make_fsdp_trainer"]


class FSDPTrainerConfig(PluginConfig):
    """Configuration of the ``fsdp`` trainer backend (``trainer:`` section of a run config)."""

    type: Literal["fsdp"] = "fsdp"
    lr: float = Field(1e-5, ge=0)
    """Actor learning rate (AdamW)."""
    critic_lr: float = Field(1e-5, ge=0)
    """Critic learning rate (AdamW); used only with ``use_critic``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (actor and critic)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW ``(beta1, beta2)``."""
    grad_clip: float = Field(1.0, ge=0)
    """Maximum global gradient norm; 0 disables clipping (the norm is still reported)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch in ``update_actor`` / ``update_critic``."""
    micro_batch_max_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch (dynamic batching): rows are sorted by length and packed
    so that ``rows × longest row`` (padded tokens) stays at or below this; a single longer row
    forms a micro-batch alone. Gradients are accumulated over micro-batches and weighted so the
    step equals the one of the whole mini-batch."""
    param_dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Compute dtype of parameters in forward/backward (FSDP2 MixedPrecisionPolicy). Master
    weights and optimizer states stay float32, except with ``float64``: then the master
    weights, optimizer states, gradients and every computation are float64 (for numerical
    checks that must not depend on the CPU's summation order; slow)."""
    reduce_dtype: Literal["float32"] = "float32"
    """Dtype of gradient reduction across ranks (float64 with ``param_dtype: float64``)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (transformers gradient checkpointing,
    non-reentrant) to save memory."""
    checkpoint_layers: int | None = Field(None, ge=0)
    """With ``activation_checkpointing``: how many decoder layers recompute their activations
    (the first N); the other layers keep theirs, which saves their recomputation (about a third
    of their forward+backward work) at the cost of their activation memory. ``None``: every
    layer. Use it to spend memory that full checkpointing leaves unused. Must not exceed the
    model's number of decoder layers."""
    log_prob_chunk_tokens: int = Field(1024, ge=1)
    """Log-probs and the entropy metric are computed from the logits this many positions at a
    time in float32 (forward and backward), so no float32 copy of the whole ``[B, T, vocab]``
    logits is made (~10 GiB at 8k tokens and a 152k vocabulary). A trained entropy bonus
    (``algorithm.entropy_coeff != 0``) uses the whole-tensor formula."""
    offload_optimizer: bool = False
    """Keep parameters, gradients and optimizer states on the CPU (FSDP2 ``CPUOffloadPolicy``)
    when training on a GPU. A no-op when ``device`` is ``cpu`` (everything is on the CPU
    already)."""
    use_critic: bool = False
    """Build a value model (same backbone + scalar head). Needed by PPO with GAE advantages."""
    critic_warmup: int = Field(0, ge=0)
    """With a critic: ``update_actor`` does nothing (returns ``actor/warmup_skip = 1``) until
    ``update_critic`` has been called this many times."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (each rank uses ``cuda:LOCAL_RANK``)."""
    backend: str = "gloo"
    """torch.distributed backend used when the backend creates the process group itself
    (``gloo`` for CPU, ``nccl`` for GPUs)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warmup over this many optimizer steps (``LambdaLR``); 0 = constant."""
    num_workers: int = Field(1, ge=1)
    """FSDP ranks. 1: this process is the (only) rank, or ``torchrun`` started the ranks. N > 1:
    the backend is a :class:`~ferryman_trainer_fsdp.ray_group.RayFSDPGroup` that starts N Ray
    actors in one placement group, one rank each, and drives them as one backend."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved for each rank's bundle (``num_workers > 1``)."""
    num_gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs reserved for each rank's bundle; 0 with ``device: cuda`` means 1."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy of the rank bundles (``PACK``: ranks packed per node)."""
    worker_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources in each rank's bundle, e.g. ``{trainer_node: 1}`` (nodes started
    with ``ray start --resources``); ``accelerator_type:H100: 0.001`` selects a GPU type."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for Ray to place the bundles before failing with the cluster's resources."""
    num_threads: int | None = Field(None, ge=1)
    """``torch.set_num_threads`` at construction (process-wide; matters on CPU, where one
    thread is often fastest for tiny models on a busy machine). ``None`` keeps torch's default."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each AdamW beta must be in [0, 1), got {v}")
        return v


# ----------------------------------------------------------------------------- process group

_OWN_GROUP_USERS = 0
"""Backends alive in this process that share a process group one of them created."""


def _acquire_process_group(backend: str) -> bool:
    """Make sure the default process group exists. Returns True if this backend shares a group
    that ferryman created (and must release it in ``close``)."""
    global _OWN_GROUP_USERS
    if dist.is_initialized():
        if _OWN_GROUP_USERS > 0:
            _OWN_GROUP_USERS += 1
            return True
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        # launched by torchrun (or similar): the env:// rendezvous gives rank and world size
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    else:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(minutes=30),
        )
    _OWN_GROUP_USERS = 1
    return True


def _release_process_group() -> None:
    global _OWN_GROUP_USERS
    _OWN_GROUP_USERS -= 1
    if _OWN_GROUP_USERS == 0 and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- helpers


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (a collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _enable_checkpointing(
    model: torch.nn.Module, layers: list[torch.nn.Module], count: int | None = None
) -> None:
    """Non-reentrant activation checkpointing of the decoder layers (transformers' API; the
    method was renamed in transformers 5). With ``count``, only the first ``count`` layers
    recompute; the others are switched back to keeping their activations (transformers'
    checkpointing layers test their own ``gradient_checkpointing`` flag in ``forward``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if count is None:
        return
    if count > len(layers):
        raise ValueError(
            f"trainer.checkpoint_layers: {count} exceeds the model's {len(layers)} decoder layers"
        )
    for layer in layers[count:]:
        if not hasattr(layer, "gradient_checkpointing"):
            raise TypeError(
                f"trainer.checkpoint_layers: {type(layer).__name__} has no per-layer "
                "gradient_checkpointing flag; only all-layer checkpointing works for this model"
            )
        layer.gradient_checkpointing = False


def _reshard(model: torch.nn.Module | None) -> None:
    """Free the unsharded parameters of every FSDP module of ``model``.

    The root module keeps its parameters unsharded after a forward (it expects the backward to
    follow); after a no-grad pass nothing reshards it, and until something does, the module's
    registered parameters are the unsharded tensors, not the sharded ones the optimizer holds.
    """
    from torch.distributed.fsdp import FSDPModule

    if model is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _clone_tree(obj: Any) -> Any:
    """Deep copy of nested dicts/lists whose tensors are cloned onto the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tree(v) for v in obj)
    return obj


def _shift_right(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, t-1]`` results for tokens ``1..t-1`` → ``[b, width]`` with zeros at position 0 and
    beyond the sub-batch's own width."""
    return F.pad(x, (1, width - 1 - x.shape[1]))


def _onloaded(method: Callable) -> Callable:
    """Bring an offloaded backend back to its device before ``method`` runs (see
    :meth:`FSDPTrainerBackend.offload`)."""
    import functools

    @functools.wraps(method)
    def wrapper(self: FSDPTrainerBackend, *args: Any, **kwargs: Any) -> Any:
        if self._offloaded:
            self.onload()
        return method(self, *args, **kwargs)

    return wrapper


class _MicroBatch:
    __slots__ = ("rows", "batch", "real")

    def __init__(self, rows: list[int], batch: TrainBatch, real: bool) -> None:
        self.rows = rows
        self.batch = batch
        self.real = real


class FSDPTrainerBackend:
    """:class:`ferryman.protocols.TrainerBackend` on FSDP2 (see the module docstring)."""

    def __init__(
        self,
        config: FSDPTrainerConfig,
        *,
        model_path: str,
        algorithm: AlgorithmConfig | None = None,
        seed: int = 0,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.config = config
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.model_path = str(model_path)
        self.seed = int(seed)
        self._closed = False
        self._offloaded = False
        self._offloaded_states: list[tuple[dict[str, Any], str]] = []
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._owns_group = _acquire_process_group(config.backend)
        try:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            if config.device.startswith("cuda"):
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
                self.device = torch.device("cuda", local_rank)
                torch.cuda.set_device(self.device)
                mesh_type = "cuda"
            else:
                self.device = torch.device(config.device)
                mesh_type = self.device.type
            self.mesh = init_device_mesh(mesh_type, (self.world_size,))
            torch.manual_seed(self.seed)

            self.has_critic: bool = bool(config.use_critic)
            self.has_reference: bool = self.algorithm.kl_coef > 0

            self.actor = self._load_causal_lm(trainable=True)
            self.actor_optim = self._make_optimizer(self.actor, config.lr)
            self.actor_sched = self._make_scheduler(self.actor_optim)
            self.ref = self._load_causal_lm(trainable=False) if self.has_reference else None
            self.critic = None
            self.critic_optim = None
            self.critic_sched = None
            if self.has_critic:
                self.critic = self._load_critic()
                self.critic_optim = self._make_optimizer(self.critic, config.critic_lr)
                self.critic_sched = self._make_scheduler(self.critic_optim)
            self.counters: dict[str, int] = {
                "actor_updates": 0,
                "actor_steps": 0,
                "critic_updates": 0,
                "critic_steps": 0,
            }
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ construction
    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
        reduce = torch.float64 if self.config.param_dtype == "float64" else dtypes[self.config.reduce_dtype]
        return MixedPrecisionPolicy(param_dtype=dtypes[self.config.param_dtype], reduce_dtype=reduce)

    @property
    def _master_dtype(self) -> torch.dtype:
        """Dtype of the master weights and optimizer states."""
        return torch.float64 if self.config.param_dtype == "float64" else torch.float32

    def _shard(self, model: torch.nn.Module, layers: Any, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kwargs: dict[str, Any] = {"mesh": self.mesh, "mp_policy": self._mp_policy()}
        # on the CPU everything lives in host memory already: offloading is a no-op there
        offload = trainable and self.config.offload_optimizer and self.device.type == "cuda"
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        else:
            model.to(self.device)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _load_causal_lm(self, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self._master_dtype)
        model.config.use_cache = False
        if trainable and self.config.activation_checkpointing:
            _enable_checkpointing(model, self._decoder_layers(model), self.config.checkpoint_layers)
        if not trainable:
            model.requires_grad_(False)
        model.eval()
        return self._shard(model, self._decoder_layers(model), trainable)

    def _load_critic(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForTokenClassification

        cfg = AutoConfig.from_pretrained(self.model_path, num_labels=1)
        # dropout 0: the value head must be deterministic (transformers defaults it to 0.1)
        cfg.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            self.model_path, config=cfg, dtype=self._master_dtype
        )
        model.config.use_cache = False
        if self.config.activation_checkpointing:
            _enable_checkpointing(model, self._decoder_layers(model), self.config.checkpoint_layers)
        model.eval()
        return self._shard(model, self._decoder_layers(model), True)

    @staticmethod
    def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise TypeError(
                f"FSDPTrainerBackend: cannot find the decoder layers of {type(model).__name__} "
                "(expected <model>.<base_model_prefix>.layers)"
            )
        return list(layers)

    def _make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        # On GPUs (states on the GPU, or on the host with offload) the fused AdamW kernel: one
        # pass per tensor and no foreach temporaries, which at 7B on one GPU are the ~25 GiB
        # between fitting and not. On the CPU device torch's default (foreach) stays.
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=lr,
            betas=tuple(self.config.betas),
            weight_decay=self.config.weight_decay,
            fused=True if self.device.type == "cuda" else None,
        )

    def _make_scheduler(self, optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        warmup = self.config.lr_warmup_steps

        def factor(step: int) -> float:
            return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)

        return torch.optim.lr_scheduler.LambdaLR(optim, factor)

    # ------------------------------------------------------------------ data parallel plumbing
    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.world_size == 1:
            return t
        op = dist.ReduceOp.SUM if op is None else op
        moved = t.to(self.device)
        dist.all_reduce(moved, op=op)
        return moved.to(t.device)

    def _local_micro_batches(self, batch: TrainBatch, rows: list[int] | None = None) -> list[_MicroBatch]:
        """This rank's share of ``rows`` (default: all rows) cut into token-budget micro-batches,
        padded with dummy micro-batches to the largest count of any rank."""
        rows = list(range(batch.batch_size)) if rows is None else rows
        mine = rows[self.rank :: self.world_size]
        out: list[_MicroBatch] = []
        if mine:
            local = batch.select(mine)
            for idx, sub in local.micro_batches(max_tokens=self.config.micro_batch_max_tokens):
                out.append(_MicroBatch([mine[i] for i in idx], sub, True))
        if self.world_size > 1:
            count = self._all_reduce(torch.tensor([len(out)], dtype=torch.long), dist.ReduceOp.MAX)
            dummy = batch.select(rows[:1])
            while len(out) < int(count.item()):
                out.append(_MicroBatch([], dummy, False))
        return out

    def _inputs(self, sub: TrainBatch) -> dict[str, torch.Tensor]:
        return {
            "input_ids": sub.input_ids.to(self.device),
            "attention_mask": sub.attention_mask.to(self.device),
            "position_ids": sub.position_ids.to(self.device),
        }

    def _logits(self, model: torch.nn.Module, sub: TrainBatch) -> torch.Tensor:
        logits = model(**self._inputs(sub), use_cache=False).logits
        temperature = float(sub.meta.get("temperature", 1.0) or 1.0)
        if temperature != 1.0:
            logits = logits / temperature
        return logits

    def _token_log_probs(self, logits: torch.Tensor, sub: TrainBatch) -> torch.Tensor:
        ids = sub.input_ids.to(logits.device)
        lp = lean_log_probs_from_logits(logits[:, :-1], ids[:, 1:], self.config.log_prob_chunk_tokens)
        lp = _shift_right(lp, sub.seq_len)
        return lp * sub.attention_mask.to(lp.device, lp.dtype)

    def _token_values(self, model: torch.nn.Module, sub: TrainBatch) -> torch.Tensor:
        v = model(**self._inputs(sub), use_cache=False).logits[..., 0]
        v = v.to(torch.promote_types(v.dtype, torch.float32))  # float64 stays float64
        v = _shift_right(v[:, :-1], sub.seq_len)
        return v * sub.attention_mask.to(v.device, v.dtype)

    @torch.no_grad()
    def _gather_per_token(
        self, batch: TrainBatch, model: torch.nn.Module, fn: Callable[[TrainBatch], torch.Tensor]
    ) -> torch.Tensor:
        out = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.float32)
        try:
            for mb in self._local_micro_batches(batch):
                res = fn(mb.batch).float().cpu()
                if mb.real:
                    out[mb.rows, : res.shape[1]] = res
        finally:
            _reshard(model)
        return self._all_reduce(out)

    # ------------------------------------------------------------------ no-grad passes
    @_onloaded
    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        self.actor.eval()
        return self._gather_per_token(
            batch, self.actor, lambda sub: self._token_log_probs(self._logits(self.actor, sub), sub)
        )

    @_onloaded
    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError(
                "FSDPTrainerBackend: no reference model (it is built only when algorithm.kl_coef > 0)"
            )
        return self._gather_per_token(
            batch, self.ref, lambda sub: self._token_log_probs(self._logits(self.ref, sub), sub)
        )

    @_onloaded
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("FSDPTrainerBackend: no critic (set trainer.use_critic: true)")
        self.critic.eval()
        return self._gather_per_token(batch, self.critic, lambda sub: self._token_values(self.critic, sub))

    # ------------------------------------------------------------------ updates
    def _micro_weights(self, mbs: list[_MicroBatch]) -> list[tuple[float, float, float]]:
        """Per local micro-batch ``(grad_weight, loss_share, token_share)``.

        ``loss_share`` is the micro-batch's share of the mini-batch's aggregation units (masked
        tokens for token-mean; rows with at least one masked token for the seq-mean modes, a
        segment of a split agent run as its share of the run's tokens, as
        :func:`ferryman.algorithms.agg_loss` counts them), so the sum of ``loss_share × micro
        loss`` equals the mini-batch loss. ``grad_weight = loss_share × world_size`` because
        FSDP averages gradients over ranks. ``token_share`` (share of masked tokens) weighs
        token-level metrics such as the clip fraction."""
        mode = self.algorithm.loss_agg_mode
        tokens = [float(mb.batch.loss_mask.sum().item()) if mb.real else 0.0 for mb in mbs]
        units = [agg_units(mb.batch.loss_mask, mode, mb.batch.run_tokens) if mb.real else 0.0 for mb in mbs]
        totals = self._all_reduce(torch.tensor([sum(units), sum(tokens)], dtype=torch.float64))
        total_units, total_tokens = float(totals[0]), float(totals[1])
        out = []
        for u, t in zip(units, tokens, strict=True):
            share = u / total_units if total_units > 0 else 0.0
            out.append((share * self.world_size, share, t / total_tokens if total_tokens > 0 else 0.0))
        return out

    def _optimizer_step(
        self, model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any
    ) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_value = float(_full(norm).item())
        if math.isfinite(norm_value):
            optim.step()
            sched.step()
        else:
            log.warning("FSDPTrainerBackend: non-finite gradient norm %s, step skipped", norm_value)
        optim.zero_grad(set_to_none=True)
        return norm_value

    def _reduce_metrics(self, sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        if not keys:
            return {}
        vals = torch.tensor([sums[k] for k in keys] + [counts[k] for k in keys], dtype=torch.float64)
        vals = self._all_reduce(vals)
        n = len(keys)
        return {k: float(vals[i] / vals[n + i]) if vals[n + i] > 0 else 0.0 for i, k in enumerate(keys)}

    @_onloaded
    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        if batch.old_log_probs is None or batch.advantages is None:
            raise ValueError("update_actor: the batch needs old_log_probs and advantages")
        if self.has_critic and self.counters["critic_updates"] < self.config.critic_warmup:
            self.counters["actor_updates"] += 1
            return {"actor/warmup_skip": 1.0}
        alg = self.algorithm
        use_kl = alg.kl_coef > 0
        if use_kl and batch.ref_log_probs is None:
            batch = replace(batch, ref_log_probs=self.compute_ref_log_probs(batch))
        mini_batches = split_groups(batch.group_index, int(batch.meta.get("num_mini_batches", 1)))

        sums: dict[str, float] = {}
        counts: dict[str, float] = {}

        def add(key: str, value: float, weight: float) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            counts[key] = counts.get(key, 0.0) + weight

        self.actor_optim.zero_grad(set_to_none=True)
        self.actor.train()
        for _ in range(self.config.ppo_epochs):
            for rows in mini_batches:
                mbs = self._local_micro_batches(batch, rows)
                weights = self._micro_weights(mbs)
                for mb, (w, share, tok_share) in zip(mbs, weights, strict=True):
                    sub = mb.batch
                    logits = self._logits(self.actor, sub)
                    lp = self._token_log_probs(logits, sub)
                    dev = lp.device
                    if alg.entropy_coeff != 0:
                        ent = entropy_from_logits(logits[:, :-1])
                    else:  # reported only: no graph kept
                        ent = lean_entropy_from_logits(logits[:, :-1], self.config.log_prob_chunk_tokens)
                    loss, am = actor_objective(
                        lp,
                        _shift_right(ent, sub.seq_len),
                        sub.old_log_probs.to(dev, torch.float32),
                        sub.advantages.to(dev, torch.float32),
                        sub.loss_mask.to(dev, torch.float32),
                        alg,
                        ref_log_probs=sub.ref_log_probs.to(dev, torch.float32) if use_kl else None,
                        is_weights=None if sub.is_weights is None else sub.is_weights.to(dev, torch.float32),
                        run_tokens=None if sub.run_tokens is None else sub.run_tokens.to(dev, torch.float32),
                    )
                    (loss * w).backward()
                    if mb.real:
                        for key in ("pg_loss", "kl_loss", "entropy"):
                            add(f"actor/{key}", am[key], share)
                        add("actor/pg_clipfrac", am["pg_clipfrac"], tok_share)
                        add("actor/ppo_kl", am["ppo_kl"], tok_share)
                lr = float(self.actor_optim.param_groups[0]["lr"])
                norm = self._optimizer_step(self.actor, self.actor_optim, self.actor_sched)
                self.counters["actor_steps"] += 1
                # the same value on every rank: weights 1/world sum to one count per step
                add("actor/grad_norm", norm, 1.0 / self.world_size)
                add("actor/lr", lr, 1.0 / self.world_size)
        self.actor.eval()
        self.counters["actor_updates"] += 1
        return self._reduce_metrics(sums, counts)

    @_onloaded
    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        if self.critic is None:
            raise RuntimeError("FSDPTrainerBackend: no critic (set trainer.use_critic: true)")
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic: the batch needs values (old values) and returns")
        alg = self.algorithm
        mini_batches = split_groups(batch.group_index, int(batch.meta.get("num_mini_batches", 1)))
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}

        def add(key: str, value: float, weight: float) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            counts[key] = counts.get(key, 0.0) + weight

        self.critic_optim.zero_grad(set_to_none=True)
        self.critic.train()
        for _ in range(self.config.ppo_epochs):
            for rows in mini_batches:
                mbs = self._local_micro_batches(batch, rows)
                weights = self._micro_weights(mbs)
                for mb, (w, share, tok_share) in zip(mbs, weights, strict=True):
                    sub = mb.batch
                    values = self._token_values(self.critic, sub)
                    dev = values.device
                    vf_loss, vf_m = value_loss(
                        values,
                        sub.values.to(dev, torch.float32),
                        sub.returns.to(dev, torch.float32),
                        sub.loss_mask.to(dev, torch.float32),
                        clip=alg.value_clip,
                        agg=alg.loss_agg_mode,
                        run_tokens=None if sub.run_tokens is None else sub.run_tokens.to(dev, torch.float32),
                    )
                    (vf_loss * w).backward()
                    if mb.real:
                        add("critic/vf_loss", float(vf_loss.detach().item()), share)
                        add("critic/vf_clipfrac", vf_m["vf_clipfrac"], tok_share)
                lr = float(self.critic_optim.param_groups[0]["lr"])
                norm = self._optimizer_step(self.critic, self.critic_optim, self.critic_sched)
                self.counters["critic_steps"] += 1
                add("critic/grad_norm", norm, 1.0 / self.world_size)
                add("critic/lr", lr, 1.0 / self.world_size)
        self.critic.eval()
        self.counters["critic_updates"] += 1
        return self._reduce_metrics(sums, counts)

    # ------------------------------------------------------------------ weights
    @_onloaded
    def iter_weight_buckets(self, bucket_bytes: int, *, device: str = "cpu") -> Iterator[NamedTensors]:
        """Full actor tensors named as in the transformers model's ``state_dict()`` (so
        ``load_state_dict`` / ``from_pretrained`` accept them), float32, detached, contiguous,
        on the CPU (copies). With ``device`` other than ``cpu`` (a weight sync whose buffers are
        on the GPU) they stay on this trainer's device, as gathered (they may share memory
        with the parameters: valid until the next update). A tied parameter appears once, under
        its first name (for tied embeddings: ``model.embed_tokens.weight``, no
        ``lm_head.weight``). Every rank must iterate (each tensor is gathered with a
        collective); every rank yields the same buckets."""
        if bucket_bytes <= 0:
            raise ValueError(f"iter_weight_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
        _reshard(self.actor)
        seen: set[int] = set()
        bucket: NamedTensors = []
        size = 0
        for name, t in self.actor.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            full = _full(t.detach())
            full = full.to("cpu", copy=True).contiguous() if device == "cpu" else full.contiguous()
            nbytes = full.numel() * full.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, full))
            size += nbytes
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ checkpoints
    def _model_optim_state(self, model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        _reshard(model)
        msd, osd = get_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {"model": _clone_tree(msd), "optim": _clone_tree(osd), "sched": sched.state_dict()}

    def _load_model_optim_state(
        self, model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        _reshard(model)
        options = StateDictOptions(full_state_dict=True)
        set_state_dict(
            model,
            optim,
            model_state_dict=_clone_tree(state["model"]),
            optim_state_dict=_clone_tree(state["optim"]),
            options=options,
        )
        sched.load_state_dict(state["sched"])

    @_onloaded
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Full (unsharded) CPU state: actor model + optimizer + scheduler, the same for the
        critic, counters and RNG states. The tensors are copies. Every rank must call it (the
        gather is a collective); with several ranks only rank 0's result holds the model and
        optimizer tensors (the others get empty dicts), so save rank 0's. The reference model is
        not saved (it is the initial actor, reloaded from ``model_path``)."""
        state: dict[str, Any] = {
            "format": 1,
            "actor": self._model_optim_state(self.actor, self.actor_optim, self.actor_sched),
            "critic": None,
            "counters": dict(self.counters),
            "rng": {"cpu": torch.get_rng_state()},
        }
        if self.critic is not None:
            state["critic"] = self._model_optim_state(self.critic, self.critic_optim, self.critic_sched)
        if self.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    @_onloaded
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict_for_checkpoint`. Every rank must call it; with
        several ranks only rank 0's ``state`` is used (it is broadcast to the others, whose
        argument is ignored), and every rank then takes its own shard."""
        if self.world_size > 1:
            holder = [state if self.rank == 0 else None]
            dist.broadcast_object_list(holder, src=0)
            state = holder[0]
        self._load_model_optim_state(self.actor, self.actor_optim, self.actor_sched, state["actor"])
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError("load_checkpoint_state: this backend has a critic but the checkpoint has none")
            self._load_model_optim_state(self.critic, self.critic_optim, self.critic_sched, state["critic"])
        self.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        rng = state.get("rng", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # ------------------------------------------------------------------ distributed checkpoints
    def _trained(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer, Any]]:
        out = [("actor", self.actor, self.actor_optim, self.actor_sched)]
        if self.critic is not None:
            out.append(("critic", self.critic, self.critic_optim, self.critic_sched))
        return out

    def _sharded_state(self, with_optim: dict[str, bool]) -> dict[str, Any]:
        """Sharded (DTensor) state dicts, views of the live parameters and optimizer states."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state: dict[str, Any] = {}
        for name, model, optim, _ in self._trained():
            _reshard(model)
            if with_optim[name]:
                msd, osd = get_state_dict(model, optim)
                state[name] = {"model": msd, "optim": osd}
            else:
                state[name] = {"model": get_model_state_dict(model)}
        return state

    @_onloaded
    def save_checkpoint(self, path: str) -> None:
        """Save the complete training state under the directory ``path`` with torch distributed
        checkpointing (``torch.distributed.checkpoint.save``): each rank writes its own shards
        of the actor's (and critic's) parameters and AdamW states, no rank gathers the whole
        model. Scheduler states, counters and every rank's RNG states go to ``extra.pt`` (rank
        0). Every rank must call it with the same ``path`` (a shared filesystem for several
        hosts). An optimizer that has not stepped yet has no state and none is saved (asking
        for one would create a ``step = 1`` state and change the next update)."""
        import torch.distributed.checkpoint as dcp

        os.makedirs(path, exist_ok=True)
        with_optim = {name: bool(optim.state) for name, _, optim, _ in self._trained()}
        dcp.save(self._sharded_state(with_optim), checkpoint_id=path)
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        rngs: list[Any] = [rng]
        if self.world_size > 1:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, rng)
        if self.rank == 0:
            extra = {
                "format": 2,
                "world_size": self.world_size,
                "with_optim": with_optim,
                "scheds": {name: sched.state_dict() for name, _, _, sched in self._trained()},
                "counters": dict(self.counters),
                "rng": rngs,
            }
            torch.save(extra, os.path.join(path, "extra.pt"))
        if self.world_size > 1:
            dist.barrier()

    @_onloaded
    def load_checkpoint(self, path: str) -> None:
        """Load a state saved by :meth:`save_checkpoint`, on any number of ranks (DCP reshards:
        a checkpoint of 2 ranks loads on 1 and the other way round). Every rank must call it.
        RNG states are restored per rank when the world size is the one saved, else rank 0's
        state is used everywhere."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        extra_path = os.path.join(path, "extra.pt")
        if not os.path.isfile(extra_path):
            raise ValueError(f"load_checkpoint: {path} is not a checkpoint of this backend (no extra.pt)")
        extra = torch.load(extra_path, weights_only=False)
        saved = set(extra["with_optim"])
        have = {name for name, *_ in self._trained()}
        if saved != have:
            raise ValueError(f"load_checkpoint: the checkpoint holds {sorted(saved)}, this backend trains {sorted(have)} (trainer.use_critic differs)")
        state = self._sharded_state(extra["with_optim"])
        dcp.load(state, checkpoint_id=path)
        for name, model, optim, sched in self._trained():
            if extra["with_optim"][name]:
                set_state_dict(model, optim, model_state_dict=state[name]["model"], optim_state_dict=state[name]["optim"])
            else:
                set_model_state_dict(model, state[name]["model"])
                optim.state.clear()
            sched.load_state_dict(extra["scheds"][name])
            _reshard(model)
        self.counters.update({k: int(v) for k, v in extra["counters"].items()})
        rngs = extra["rng"]
        rng = rngs[self.rank] if extra["world_size"] == self.world_size else rngs[0]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # ------------------------------------------------------------------ colocated mode
    def _models(self) -> list[torch.nn.Module]:
        return [m for m in (self.actor, self.ref, self.critic) if m is not None]

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.actor_optim, self.critic_optim) if o is not None]

    @property
    def offloaded(self) -> bool:
        """True between :meth:`offload` and the next :meth:`onload`."""
        return self._offloaded

    @torch.no_grad()
    def offload(self) -> None:
        """Free the accelerator: move every model's (sharded) parameters and every optimizer
        state to host memory and return the cached blocks to the driver, so that a colocated
        inference engine can use the memory. Gradients are already freed after each step. Any
        later call that needs the models (:meth:`onload` explicitly, or any compute, update,
        weight-streaming or checkpoint method) moves them back first. Nothing moves on the CPU
        device or with ``offload_optimizer`` (everything already lives on the host); the
        backend is only marked offloaded."""
        if self._offloaded:
            return
        if self.device.type == "cpu" or self.config.offload_optimizer:
            self._offloaded = True
            return
        for model in self._models():
            _reshard(model)
            model.cpu()
        moved: list[tuple[dict[str, Any], str]] = []
        for optim in self._optimizers():
            for state in optim.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                        state[key] = value.to("cpu")
                        moved.append((state, key))
        self._offloaded_states = moved
        self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @torch.no_grad()
    def onload(self) -> None:
        """Undo :meth:`offload` (a no-op if the backend is not offloaded)."""
        if not self._offloaded:
            return
        for model in self._models():
            model.to(self.device)
        for state, key in self._offloaded_states:
            state[key] = state[key].to(self.device)
        self._offloaded_states = []
        self._offloaded = False

    # ------------------------------------------------------------------ lifecycle
    def peak_memory(self) -> dict[str, float]:
        """This rank's peak memory (:func:`ferryman.metrics.peak_memory`: peak RSS, and on a GPU
        the CUDA allocator's peak); the trainer loop reports it as ``memory/trainer_*`` (with
        ``num_workers > 1``, rank 0's)."""
        from ferryman.metrics import peak_memory

        return peak_memory("trainer")

    def close(self) -> None:
        """Release the models; destroy the process group if this backend (or another backend
        of this process sharing it) created it and this is its last user."""
        if self._closed:
            return
        self._closed = True
        for name in ("actor", "ref", "critic", "actor_optim", "critic_optim", "actor_sched", "critic_sched"):
            if hasattr(self, name):
                setattr(self, name, None)
        if self._owns_group:
            _release_process_group()


def make_fsdp_trainer(
    config: FSDPTrainerConfig,
    *,
    model_path: str,
    algorithm: AlgorithmConfig | None = None,
    seed: int = 0,
    **_: Any,
) -> FSDPTrainerBackend:
    """Factory registered as trainer ``fsdp`` (see :mod:`ferryman.specs` for the keywords)."""
    algorithm = algorithm if algorithm is not None else AlgorithmConfig()
    if algorithm.adv_estimator == "gae" and not config.use_critic:
        raise ValueError(
            "trainer.use_critic must be true with algorithm.adv_estimator='gae' (GAE needs values)"
        )
    if config.num_workers > 1:
        from ferryman_trainer_fsdp.ray_group import RayFSDPGroup

        return RayFSDPGroup(config, model_path=model_path, algorithm=algorithm, seed=seed)  # type: ignore[return-value]
    return FSDPTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed)
