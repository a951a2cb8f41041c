"""The ``megatron`` trainer backend: the RL side (micro-batches, losses, metrics, weighting),
written once over a *runtime* that owns the models.

:class:`MegatronTrainerBackend` implements :class:`ferryman.protocols.TrainerBackend`. What
is Megatron-specific (building ``GPTModel`` per pipeline stage, ``get_forward_backward_func``,
the distributed optimizer, gathering weights, ``dist_checkpointing``) lives in a runtime:
:class:`ferryman_trainer_megatron.megatron_runtime.MegatronRuntime` on GPUs, or
:class:`ferryman_trainer_megatron.testing.FakeMegatronRuntime` (a transformers model standing in
for Megatron, on CPU) in the tests of this plumbing.

Execution model (as in the fsdp backend): SPMD, every rank gets the same batch. Rows are split
over the *data-parallel* ranks (rank ``r`` of ``d`` takes rows ``r, r + d, …``); the ranks of one
model replica (tensor, pipeline) take the same rows. Data-parallel ranks run the same number of
micro-batches (zero-weight dummies pad the shorter lists) because MoE's expert all-to-all spans
them. A micro-batch's loss is weighted by its share of the mini-batch's aggregation units over
all data-parallel ranks, and Megatron sums (not averages) gradients over them
(``calculate_per_token_loss``), so the step is the one of the whole mini-batch whatever the
token budget. Per-token outputs are written only by the *reporting* rank of each replica (last
pipeline stage, tensor-parallel rank 0) and summed over the world, so every rank returns the
full ``[B, T]`` tensor.

Alignment follows :mod:`ferryman.batch` (position ``t`` scores token ``t``; position 0 and
padding are 0); ``values[t]`` is the value head's output at ``t - 1``. ``batch.meta`` keys read:
``num_mini_batches``, ``temperature`` and, with ``router_replay``, ``routed_experts``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ferryman.algorithms import actor_objective, agg_units, value_loss
from ferryman.batch import TrainBatch, split_groups
from ferryman.config import AlgorithmConfig
from ferryman.protocols import NamedTensors
from ferryman_trainer_megatron.config import MegatronTrainerConfig
from ferryman_trainer_megatron.context_parallel import ContextSplit
from ferryman_trainer_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy

log = logging.getLogger(__name__)

__all__ = ["MegatronTrainerBackend", "LogitsShard", "Runtime", "actor_loss", "token_log_probs"]


# ----------------------------------------------------------------------------- runtime seam


@dataclass
class LogitsShard:
    """What a causal-LM forward gives the loss: this rank's slice of the (padded) vocabulary."""

    logits: torch.Tensor
    """``[b, t, V_pad / tp]`` in the compute dtype (never copied to float32 whole)."""
    vocab_start: int
    vocab_size: int
    """The true (unpadded) vocabulary."""
    group: Any = None
    """The tensor-parallel process group (``None``: one rank holds the whole vocabulary)."""
    context: ContextSplit | None = None
    """With context parallelism: ``logits`` hold this rank's positions of the padded rows
    (``[b, 2c, V_pad / tp]``, the load-balanced split); ``None``: positions ``0..t-1`` in order."""


Head = Callable[[Any, TrainBatch], tuple[torch.Tensor, dict[str, Any]]]
"""``head(output, micro_batch) -> (loss, record)``: ``output`` is a :class:`LogitsShard` (actor,
reference) or ``[b, t]`` float values (critic); ``loss`` is already weighted; ``record`` holds
whatever the caller wants back (tensors are moved to the CPU)."""


class Runtime(Protocol):
    """What the backend needs from the model side (Megatron, or a fake on CPU)."""

    dp_rank: int
    dp_size: int
    reporter: bool
    """True on the one rank per model replica whose head outputs count (last pipeline stage,
    tensor-parallel rank 0)."""

    def build(self, role: str) -> Any:
        """Build and load the ``actor``, ``critic`` or ``ref`` model; returns a handle."""
        ...

    def run(self, handle: Any, micro_batches: list[TrainBatch], head: Head, forward_only: bool) -> list[dict[str, Any]]:
        """Forward (and with ``forward_only=False`` backward, gradients accumulated) over the
        micro-batches in order; the head's records, one per micro-batch, on reporting ranks
        (an empty list elsewhere)."""
        ...

    def step(self, handle: Any, lr: float) -> float:
        """Optimizer step at learning rate ``lr`` (clip included), gradients zeroed; returns
        the global gradient norm (the same on every rank; a non-finite one skips the step)."""
        ...

    def world_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def dp_max(self, t: torch.Tensor) -> torch.Tensor: ...

    def iter_hf_weights(self, handle: Any, *, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full HF-named tensor of the model, float32 CPU (``on_device``: on this rank's
        device, in the parameters' dtype), the same on every rank."""
        ...

    def save(self, handles: dict[str, Any], path: str, with_optim: dict[str, bool]) -> None: ...

    def load(self, handles: dict[str, Any], path: str, with_optim: dict[str, bool]) -> None: ...

    def save_extra(self, path: str, extra: dict[str, Any]) -> None:
        """Write ``extra`` (counters, RNG of every rank) beside the shards (rank 0 writes)."""
        ...

    def load_extra(self, path: str) -> dict[str, Any] | None: ...

    def shared_tempdir(self) -> str:
        """A new directory every rank sees (rank 0 creates it; a shared filesystem on many hosts)."""
        ...

    def rng_state(self) -> dict[str, Any]: ...

    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    def offload(self, handles: dict[str, Any]) -> None: ...

    def onload(self, handles: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- loss plumbing


def _shift_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(x, (1, width - 1 - x.shape[1]))


def token_log_probs(out: LogitsShard, sub: TrainBatch, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, entropy)`` ``[b, t]`` aligned with ``sub.input_ids`` (position 0 and padding
    0) from a vocab-parallel logits shard, at ``sub.meta["temperature"]`` (default 1)."""
    logits = out.logits
    ids = sub.input_ids.to(logits.device)
    temperature = float(sub.meta.get("temperature", 1.0) or 1.0)
    split = out.context if out.context is not None and out.context.size > 1 else None
    # position p scores the next token; with context parallelism: every position of this rank's
    # share of the padded rows, with the padded row's labels split like the logits
    if split is not None:
        labels = split.split(F.pad(ids[:, 1:], (0, split.length - sub.seq_len + 1)), dim=1)
    else:
        logits, labels = logits[:, : sub.seq_len - 1], ids[:, 1:]
    lp, ent = vocab_parallel_log_probs_and_entropy(
        logits, labels, vocab_start=out.vocab_start, vocab_size=out.vocab_size, group=out.group,
        chunk_tokens=chunk_tokens, temperature=temperature,
    )
    if split is not None:  # whole rows, the same on every rank of the group: one all-gather
        both = split.gather(torch.stack((lp, ent), dim=-1))[:, : sub.seq_len - 1]
        lp, ent = both[..., 0], both[..., 1]
    keep = sub.attention_mask.to(lp.device, lp.dtype)
    return _shift_right(lp, sub.seq_len) * keep, _shift_right(ent, sub.seq_len) * keep


def actor_loss(
    lp: torch.Tensor, ent: torch.Tensor, sub: TrainBatch, alg: AlgorithmConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor objective of one micro-batch: :func:`ferryman.algorithms.actor_objective`
    (the fsdp backend's too) over ``sub``'s tensors on ``lp``'s device."""
    dev = lp.device

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev, torch.float32)

    return actor_objective(
        lp, ent, on(sub.old_log_probs), on(sub.advantages), on(sub.loss_mask), alg,
        ref_log_probs=on(sub.ref_log_probs) if alg.kl_coef > 0 else None,
        is_weights=on(sub.is_weights), run_tokens=on(sub.run_tokens),
    )


@dataclass
class _Micro:
    rows: list[int]
    batch: TrainBatch
    real: bool


def _onloaded(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: MegatronTrainerBackend, *args: Any, **kwargs: Any) -> Any:
        if self._offloaded:
            self.onload()
        return method(self, *args, **kwargs)

    return wrapper


class MegatronTrainerBackend:
    """:class:`ferryman.protocols.TrainerBackend` over a :class:`Runtime` (module docstring)."""

    def __init__(
        self,
        config: MegatronTrainerConfig,
        *,
        model_path: str,
        algorithm: AlgorithmConfig | None = None,
        seed: int = 0,
        runtime: Runtime | None = None,
    ) -> None:
        self.config = config
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.model_path = str(model_path)
        self.seed = int(seed)
        self._closed = False
        self._offloaded = False
        self._state_dirs: list[str] = []
        if runtime is None:
            from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime

            runtime = MegatronRuntime(config, model_path=self.model_path, seed=self.seed)
        self.rt = runtime
        try:
            self.has_critic: bool = bool(config.use_critic)
            self.has_reference: bool = self.algorithm.kl_coef > 0
            self.actor = self.rt.build("actor")
            self.ref = self.rt.build("ref") if self.has_reference else None
            self.critic = self.rt.build("critic") if self.has_critic else None
            self.counters: dict[str, int] = {"actor_updates": 0, "actor_steps": 0, "critic_updates": 0, "critic_steps": 0}
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ helpers
    def _lr(self, base: float, steps: int) -> float:
        warmup = self.config.lr_warmup_steps
        return base if warmup <= 0 else base * min(1.0, (steps + 1) / warmup)

    def _micro_batches(self, batch: TrainBatch, rows: list[int] | None = None) -> list[_Micro]:
        rows = list(range(batch.batch_size)) if rows is None else rows
        mine = rows[self.rt.dp_rank :: self.rt.dp_size]
        out: list[_Micro] = []
        if mine:
            local = batch.select(mine)
            for idx, sub in local.micro_batches(max_tokens=self.config.micro_batch_max_tokens):
                out.append(_Micro([mine[i] for i in idx], sub, True))
        if self.rt.dp_size > 1:
            count = int(self.rt.dp_max(torch.tensor([len(out)], dtype=torch.long)).item())
            dummy = batch.select(rows[:1])
            while len(out) < count:
                out.append(_Micro([], dummy, False))
        return out

    def _weights(self, mbs: list[_Micro]) -> list[tuple[float, float, float]]:
        """``(grad weight, loss share, token share)`` per local micro-batch: its share of the
        mini-batch's aggregation units over all data-parallel ranks (gradients are summed over
        them, so the grad weight is the share itself)."""
        mode = self.algorithm.loss_agg_mode
        tokens = [float(mb.batch.loss_mask.sum().item()) if mb.real else 0.0 for mb in mbs]
        units = [agg_units(mb.batch.loss_mask, mode, mb.batch.run_tokens) if mb.real else 0.0 for mb in mbs]
        totals = self.rt.dp_sum(torch.tensor([sum(units), sum(tokens)], dtype=torch.float64))
        tu, tt = float(totals[0]), float(totals[1])
        return [(u / tu if tu > 0 else 0.0, u / tu if tu > 0 else 0.0, t / tt if tt > 0 else 0.0) for u, t in zip(units, tokens, strict=True)]

    def _reduce_metrics(self, sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
        # reporters of every replica hold sums; a key missing on non-reporters is 0 there
        keys = sorted(set(sums) | set(self._metric_keys))
        if not keys:
            return {}
        vals = torch.tensor([sums.get(k, 0.0) for k in keys] + [counts.get(k, 0.0) for k in keys], dtype=torch.float64)
        vals = self.rt.world_sum(vals)
        n = len(keys)
        return {k: float(vals[i] / vals[n + i]) if vals[n + i] > 0 else 0.0 for i, k in enumerate(keys)}

    _metric_keys: tuple[str, ...] = ()

    @torch.no_grad()
    def _per_token(self, handle: Any, batch: TrainBatch, head: Head) -> torch.Tensor:
        out = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.float32)
        mbs = self._micro_batches(batch)
        records = self.rt.run(handle, [mb.batch for mb in mbs], head, forward_only=True)
        if self.rt.reporter:
            for mb, rec in zip(mbs, records, strict=True):
                if mb.real:
                    res = rec["out"].float().cpu()
                    out[mb.rows, : res.shape[1]] = res
        return self.rt.world_sum(out)

    def _lp_head(self, out: LogitsShard, sub: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        lp, _ = token_log_probs(out, sub, self.config.log_prob_chunk_tokens)
        return lp.new_zeros(()), {"out": lp.detach()}

    def _value_head(self, values: torch.Tensor, sub: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        return values.new_zeros(()), {"out": self._token_values(values, sub).detach()}

    @staticmethod
    def _token_values(values: torch.Tensor, sub: TrainBatch) -> torch.Tensor:
        v = _shift_right(values[:, : sub.seq_len - 1].float(), sub.seq_len)
        return v * sub.attention_mask.to(v.device, v.dtype)

    # ------------------------------------------------------------------ no-grad passes
    @_onloaded
    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_token(self.actor, batch, self._lp_head)

    @_onloaded
    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError("MegatronTrainerBackend: no reference model (it is built only when algorithm.kl_coef > 0)")
        return self._per_token(self.ref, batch, self._lp_head)

    @_onloaded
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("MegatronTrainerBackend: no critic (set trainer.use_critic: true)")
        return self._per_token(self.critic, batch, self._value_head)

    # ------------------------------------------------------------------ updates
    def _update(self, handle: Any, batch: TrainBatch, head_for: Callable[[float, float, float, bool], Head],
                base_lr: float, step_key: str, prefix: str) -> dict[str, float]:
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}

        def add(key: str, value: float, weight: float) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            counts[key] = counts.get(key, 0.0) + weight

        reporters = float(self.rt.world_sum(torch.tensor([1.0 if self.rt.reporter else 0.0], dtype=torch.float64)).item())
        mini_batches = split_groups(batch.group_index, int(batch.meta.get("num_mini_batches", 1)))
        for _ in range(self.config.ppo_epochs):
            for rows in mini_batches:
                mbs = self._micro_batches(batch, rows)
                weights = self._weights(mbs)
                heads = iter([head_for(w, share, tok, mb.real) for mb, (w, share, tok) in zip(mbs, weights, strict=True)])

                def head(out: Any, sub: TrainBatch, _it: Iterator[Head] = heads) -> tuple[torch.Tensor, dict[str, Any]]:
                    return next(_it)(out, sub)

                records = self.rt.run(handle, [mb.batch for mb in mbs], head, forward_only=False)
                if self.rt.reporter:
                    for mb, (w, share, tok), rec in zip(mbs, weights, records, strict=True):
                        if mb.real:
                            for key, value in rec.items():
                                add(f"{prefix}/{key}", float(value), tok if key.endswith(("clipfrac", "ppo_kl")) else share)
                lr = self._lr(base_lr, self.counters[step_key])
                norm = self.rt.step(handle, lr)
                self.counters[step_key] += 1
                if self.rt.reporter:
                    # the same on every rank; one count per step over all reporters
                    add(f"{prefix}/grad_norm", norm, 1.0 / reporters)
                    add(f"{prefix}/lr", lr, 1.0 / reporters)
        return self._reduce_metrics(sums, counts)

    @_onloaded
    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        if batch.old_log_probs is None or batch.advantages is None:
            raise ValueError("update_actor: the batch needs old_log_probs and advantages")
        if self.has_critic and self.counters["critic_updates"] < self.config.critic_warmup:
            self.counters["actor_updates"] += 1
            return {"actor/warmup_skip": 1.0}
        alg = self.algorithm
        if alg.kl_coef > 0 and batch.ref_log_probs is None:
            batch = replace(batch, ref_log_probs=self.compute_ref_log_probs(batch))
        chunk = self.config.log_prob_chunk_tokens

        def head_for(w: float, share: float, tok: float, real: bool) -> Head:
            def head(out: LogitsShard, sub: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
                lp, ent = token_log_probs(out, sub, chunk)
                loss, metrics = actor_loss(lp, ent, sub, alg)
                return loss * w, metrics if real else {}

            return head

        self._metric_keys = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr")
        metrics = self._update(self.actor, batch, head_for, self.config.lr, "actor_steps", "actor")
        self.counters["actor_updates"] += 1
        return metrics

    @_onloaded
    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        if self.critic is None:
            raise RuntimeError("MegatronTrainerBackend: no critic (set trainer.use_critic: true)")
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic: the batch needs values (old values) and returns")
        alg = self.algorithm

        def head_for(w: float, share: float, tok: float, real: bool) -> Head:
            def head(values: torch.Tensor, sub: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
                v = self._token_values(values, sub)
                dev = v.device
                loss, m = value_loss(
                    v, sub.values.to(dev, torch.float32), sub.returns.to(dev, torch.float32),
                    sub.loss_mask.to(dev, torch.float32), clip=alg.value_clip, agg=alg.loss_agg_mode,
                    run_tokens=None if sub.run_tokens is None else sub.run_tokens.to(dev, torch.float32),
                )
                return loss * w, {"vf_loss": float(loss.detach().item()), "vf_clipfrac": m["vf_clipfrac"]} if real else {}

            return head

        self._metric_keys = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr")
        metrics = self._update(self.critic, batch, head_for, self.config.critic_lr, "critic_steps", "critic")
        self.counters["critic_updates"] += 1
        return metrics

    # ------------------------------------------------------------------ weights
    @_onloaded
    def iter_weight_buckets(self, bucket_bytes: int, *, device: str = "cpu") -> Iterator[NamedTensors]:
        """Full actor tensors named as in the HF checkpoint (``model.layers.N.self_attn.q_proj.weight``…,
        per-expert names for MoE; tied embeddings: ``model.embed_tokens.weight`` and no
        ``lm_head.weight``; vocabulary padding stripped), float32, contiguous, on the CPU, in HF
        checkpoint order; with ``device`` other than ``cpu`` (a weight sync whose buffers are on
        the GPU) on this rank's device in the parameters' dtype instead. Each tensor is gathered over tensor parallelism (QKV and gate/up
        re-split), pipeline stages and expert ranks as it is reached, so no rank ever holds more
        than one full tensor beyond the current bucket. Every rank must iterate; every rank
        yields the same buckets."""
        if bucket_bytes <= 0:
            raise ValueError(f"iter_weight_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
        bucket: NamedTensors = []
        size = 0
        for name, t in self.rt.iter_hf_weights(self.actor, on_device=device != "cpu"):
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ checkpoints
    def _handles(self) -> dict[str, Any]:
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    @_onloaded
    def save_checkpoint(self, path: str) -> None:
        """Save the training state under the directory ``path`` with Megatron's
        ``dist_checkpointing`` (each rank writes its own shards of parameters and optimizer
        states; the optimizer in its fully reshardable form, so the checkpoint loads on another
        data-parallel size) plus ``extra.pt`` (counters, RNG). An optimizer that never stepped is
        saved without states. Every rank must call it with the same ``path``."""
        import os

        os.makedirs(path, exist_ok=True)
        with_optim = {"actor": self.counters["actor_steps"] > 0}
        if self.critic is not None:
            with_optim["critic"] = self.counters["critic_steps"] > 0
        self.rt.save(self._handles(), path, with_optim)
        extra = {"format": 1, "with_optim": with_optim, "counters": dict(self.counters), "rng": self.rt.rng_state()}
        self.rt.save_extra(path, extra)

    @_onloaded
    def load_checkpoint(self, path: str) -> None:
        """Load a state saved by :meth:`save_checkpoint` (on any data-parallel size)."""
        extra = self.rt.load_extra(path)
        if extra is None:
            raise ValueError(f"load_checkpoint: {path} is not a checkpoint of this backend (no extra.pt)")
        if set(extra["with_optim"]) != set(self._handles()):
            raise ValueError(
                f"load_checkpoint: the checkpoint holds {sorted(extra['with_optim'])}, this backend trains "
                f"{sorted(self._handles())} (trainer.use_critic differs)"
            )
        self.rt.load(self._handles(), path, extra["with_optim"])
        self.counters.update({k: int(v) for k, v in extra["counters"].items()})
        self.rt.set_rng_state(extra["rng"])

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """The training state as a ``dist_checkpointing`` directory this backend owns (kept until
        :meth:`close`): Megatron's optimizer states only exist as sharded state dicts, so the
        in-memory form is a reference to the saved shards, not the tensors. Every rank must call
        it (the save is collective)."""
        path = self.rt.shared_tempdir()
        self._state_dirs.append(path)
        self.save_checkpoint(path)
        return {"format": "megatron-dist-checkpoint", "path": path}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != "megatron-dist-checkpoint":
            raise ValueError("load_checkpoint_state: not a state from this backend's state_dict_for_checkpoint")
        self.load_checkpoint(state["path"])

    # ------------------------------------------------------------------ colocated mode
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def offload(self) -> None:
        """Move parameters, gradient buffers and optimizer states to host memory (colocated
        mode); any later call onloads first."""
        if self._offloaded:
            return
        handles = self._handles()
        if self.ref is not None:
            handles["ref"] = self.ref
        self.rt.offload(handles)
        self._offloaded = True

    def onload(self) -> None:
        if not self._offloaded:
            return
        handles = self._handles()
        if self.ref is not None:
            handles["ref"] = self.ref
        self.rt.onload(handles)
        self._offloaded = False

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        import shutil

        for path in self._state_dirs:
            shutil.rmtree(path, ignore_errors=True)
        self._state_dirs = []
        for name in ("actor", "ref", "critic"):
            setattr(self, name, None)
        rt = self.__dict__.get("rt")
        if rt is not None:
            rt.close()
