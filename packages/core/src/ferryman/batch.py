"""TrainBatch: trajectories packed into right-padded tensors for the trainer.

Layout: each row is ``prompt_ids + response_ids``, right-padded to the longest row. Every
per-token tensor is [B, T] and aligned with ``input_ids``: position t describes token t
(its log-prob is log p(token_t | tokens_<t)), so position 0 is never trained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from ferryman.types import Sample, Trajectory

log = logging.getLogger(__name__)

_PER_ROW = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "loss_mask",
    "rollout_log_probs",
    "token_versions",
    "scores",
    "group_index",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "is_weights",
    "run_index",
    "run_tokens",
)
PER_ROW_META = ("routed_experts",)
"""``meta`` entries that hold one value per row and token (``[B, T, ...]``): :meth:`TrainBatch.select`
takes their rows and trims their tokens like the per-token fields (``routed_experts``: the
experts a MoE engine chose, ``[B, T, layers, top-k]``, replayed by a trainer; filled by
:func:`build_train_batch` with the layers as the engine reports them, vLLM and SGLang: every
hidden layer, a dense layer's entries 0)."""


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    """[B, T] long, right-padded with the pad id."""
    attention_mask: torch.Tensor
    """[B, T] long, 1 on real tokens."""
    position_ids: torch.Tensor
    """[B, T] long."""
    loss_mask: torch.Tensor
    """[B, T] float, 1 on tokens the policy generated (the ones trained)."""
    rollout_log_probs: torch.Tensor
    """[B, T] float, log-probs reported by the engine (0 off the loss mask)."""
    token_versions: torch.Tensor
    """[B, T] long, weight version that generated each token (-1 off the loss mask)."""
    scores: torch.Tensor
    """[B] float, trajectory reward."""
    group_index: torch.Tensor
    """[B] long, which Sample (GRPO group) the row belongs to."""
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    """[B, T] rollout importance-sampling weights (recompute path), detached."""
    run_index: torch.Tensor | None = None
    """[B] long, which agent run the row belongs to (unique across the batch). An env may
    return one run as several segments (a black-box agent that rewrote its history); each is
    a row, and rows with the same ``run_index`` count as one run: once in the GRPO group's
    baseline, and once as a sequence in the seq-mean loss modes. ``None``: one run per row."""
    run_tokens: torch.Tensor | None = None
    """[B] float, masked (trained) tokens of the row's whole run, summed over its segments; for
    the seq-mean loss modes (``algorithms.agg_loss``). ``None``: each row's own count."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Batch-wide settings (``num_mini_batches``, ``temperature``) and the per-row entries named
    in :data:`PER_ROW_META`."""

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    def select(self, rows: torch.Tensor | list[int]) -> TrainBatch:
        """A batch of the given rows, trimmed to their longest sequence."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        changes: dict[str, Any] = {}
        for name in _PER_ROW:
            t = getattr(self, name)
            changes[name] = None if t is None else t.index_select(0, idx)
        out = replace(self, **changes)
        lengths = out.attention_mask.sum(-1)
        width = int(lengths.max().item()) if len(idx) else 0
        trim: dict[str, Any] = {}
        for f in fields(out):
            t = getattr(out, f.name)
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                trim[f.name] = t[:, :width]
        meta = dict(self.meta)
        for key in PER_ROW_META:
            if meta.get(key) is not None:
                meta[key] = torch.as_tensor(meta[key]).index_select(0, idx)[:, :width]
        trim["meta"] = meta
        return replace(out, **trim)

    def micro_batches(self, max_tokens: int | None = None, max_rows: int | None = None):
        """Split into micro-batches of at most ``max_rows`` rows and (if given) at most
        ``max_tokens`` padded tokens (rows × longest row); rows are sorted by length first so that
        padding stays small. A single row longer than ``max_tokens`` forms its own micro-batch.
        Yields ``(row_indices, TrainBatch)``."""
        lengths = self.attention_mask.sum(-1).tolist()
        order = sorted(range(self.batch_size), key=lambda i: lengths[i])
        current: list[int] = []
        longest = 0
        for i in order:
            new_longest = max(longest, lengths[i])
            too_many_rows = max_rows is not None and len(current) + 1 > max_rows
            too_many_tokens = max_tokens is not None and new_longest * (len(current) + 1) > max_tokens
            if current and (too_many_rows or too_many_tokens):
                yield current, self.select(current)
                current, new_longest = [], lengths[i]
            current.append(i)
            longest = new_longest
        if current:
            yield current, self.select(current)


def split_groups(group_index: torch.Tensor, n: int) -> list[list[int]]:
    """Row indices of ``n`` mini-batches (fewer when there are fewer groups): the rows of one
    group (GRPO's prompt group) stay together, groups keep their order of first appearance and
    are spread as evenly as possible."""
    order: list[int] = []
    rows_of: dict[int, list[int]] = {}
    for row, g in enumerate(group_index.tolist()):
        if g not in rows_of:
            rows_of[g] = []
            order.append(g)
        rows_of[g].append(row)
    n = max(1, min(int(n), len(order)))
    base, extra = divmod(len(order), n)
    out: list[list[int]] = []
    start = 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append([r for g in order[start : start + size] for r in rows_of[g]])
        start += size
    return [rows for rows in out if rows]


def _routed_experts(rows: list[tuple[int, Trajectory]], width: int) -> torch.Tensor | None:
    """``meta["routed_experts"]`` of :func:`build_train_batch`, or None (see there)."""
    lists = [t.extra.get("routed_experts") for _, t in rows]
    if any(r is None for r in lists):
        return None
    shapes = set()
    for (_, t), routed in zip(rows, lists):
        # needed: every position before the last model token (its log-prob is read there)
        last = max((i for i, m in enumerate(t.response_mask) if m), default=None)
        need = 0 if last is None else len(t.prompt_ids) + last
        if len(routed) < need or len(routed) > len(t.prompt_ids) + len(t.response_ids):
            log.warning(
                "build_train_batch: trajectory %s has routed experts for %d positions, %d needed, %d tokens: "
                "meta['routed_experts'] left out", t.request_id, len(routed), need, len(t.prompt_ids) + len(t.response_ids))
            return None
        if routed:
            shapes.add(tuple(torch.as_tensor(routed[0]).shape))
    if len(shapes) > 1 or any(len(shape) != 2 for shape in shapes):
        raise ValueError(f"build_train_batch: routed experts of different shapes [layers, top-k] in one batch: {sorted(shapes)}")
    if not shapes:
        return None  # no position reported anywhere: nothing to replay
    (layers, k), = shapes
    out = torch.empty((len(rows), width, layers, k), dtype=torch.long)
    for r, routed in enumerate(lists):
        n = len(routed)
        if n:
            out[r, :n] = torch.as_tensor(routed, dtype=torch.long)
            out[r, n:] = out[r, n - 1]
        else:
            out[r] = torch.arange(k, dtype=torch.long)
    return out


def build_train_batch(samples: list[Sample], pad_token_id: int) -> TrainBatch:
    """Pack the trajectories of ``samples`` (each a GRPO group) into a TrainBatch.

    ``meta["routed_experts"]`` (MoE, for a trainer's router replay) is filled when EVERY
    trajectory has ``extra["routed_experts"]`` (per position of ``prompt_ids + response_ids``
    from 0, ``[positions][layers][top-k]``: :attr:`TokenOutput.routed_experts`, set by
    :meth:`Trajectory.append_model_tokens` and the proxy) covering at least every position
    before its last model token: a long ``[B, T, layers, top-k]`` tensor aligned with
    ``input_ids``. Positions a list does not reach (the last generated token, which the engine
    never ran, observation tokens after the last model token, and right padding) repeat the
    last reported position's experts: they influence no trained log-prob (causal attention) and
    stay valid, distinct expert ids. If any trajectory lacks the list, or one does not cover
    the positions it needs (logged), the entry is left out: a trainer asked for router replay
    then fails on the missing meta (Megatron: ``trainer.router_replay: the batch has no
    meta['routed_experts']``). Lists of different ``[layers, top-k]`` shapes are a ValueError.
    """
    rows = []
    runs: list[int] = []
    run_ids: dict[tuple[int, str], int] = {}
    for g, sample in enumerate(samples):
        for traj in sample.trajectories:
            traj.validate()
            rows.append((g, traj))
            # segments of one run share its run_id; a trajectory without one is a run of its own
            key = (g, traj.run_id) if traj.run_id is not None else (g, f"\0row{len(rows)}")
            runs.append(run_ids.setdefault(key, len(run_ids)))
    if not rows:
        raise ValueError("build_train_batch: no trajectories")
    width = max(len(t.prompt_ids) + len(t.response_ids) for _, t in rows)
    B = len(rows)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.float32)
    rollout_lp = torch.zeros((B, width), dtype=torch.float32)
    versions = torch.full((B, width), -1, dtype=torch.long)
    scores = torch.zeros(B, dtype=torch.float32)
    group = torch.zeros(B, dtype=torch.long)
    for r, (g, t) in enumerate(rows):
        p, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[r, : p + n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention_mask[r, : p + n] = 1
        if n:
            loss_mask[r, p : p + n] = torch.tensor(t.response_mask, dtype=torch.float32)
            rollout_lp[r, p : p + n] = torch.tensor(t.rollout_log_probs, dtype=torch.float32)
            versions[r, p : p + n] = torch.tensor(t.token_versions, dtype=torch.long)
        scores[r] = float(t.reward if t.reward is not None else 0.0)
        group[r] = g
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    run_index = torch.tensor(runs, dtype=torch.long)
    row_tokens = loss_mask.sum(-1)
    run_tokens = torch.zeros(len(run_ids), dtype=torch.float32).index_add_(0, run_index, row_tokens)[run_index]
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        loss_mask=loss_mask,
        rollout_log_probs=rollout_lp,
        token_versions=versions,
        scores=scores,
        group_index=group,
        run_index=run_index,
        run_tokens=run_tokens,
    )
    routed = _routed_experts(rows, width)
    if routed is not None:
        batch.meta["routed_experts"] = routed
    return batch
