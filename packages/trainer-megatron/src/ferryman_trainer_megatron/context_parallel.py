"""Context parallelism: each row's sequence split over the ``cp`` ranks of a context-parallel
group (plain torch.distributed; no Megatron import, so it is tested on CPU gloo ranks).

**Layout.** Megatron's load-balanced split: a (padded) sequence of length ``L`` is cut into
``2 × cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``, in that order
(:func:`zigzag_positions`). With causal attention the early chunks are cheap and the late ones
dear, so every rank gets one of each and the same work. Megatron's rotary embedding and
Transformer Engine's context-parallel attention expect exactly this order
(``get_pos_emb_on_this_cp_rank``), so the trainer splits token ids once per micro-batch
(:meth:`ContextSplit.split`) and the model's own parts follow.

**Attention** (:func:`context_parallel_attention`, the local layer spec's SDPA core attention
with ``cp > 1``): every rank all-gathers the keys and values of the whole sequence (in
sequence order) and attends with its own queries, each of its two chunks against the keys up to
its own end with a bottom-right aligned causal mask (``torch.nn.attention.bias.causal_lower_right``:
flash kernels on GPUs). The backward reduce-scatters the key and value gradients back to the
ranks that own those positions. This is the "all-gather" variant of context parallelism (as in
Transformer Engine's ``cp_comm_type="all_gather"``): it keeps whole-sequence keys and values
per layer (small with grouped-query attention) and does not overlap the gather with compute, as
Transformer Engine's ring (``p2p``) does.

**Per-token outputs** (log-probs, entropies, values) are gathered back to ``[B, L]`` on every
rank of the group (:meth:`ContextSplit.gather`), so the losses of :mod:`ferryman.algorithms`
run unchanged on whole rows. Its backward hands each rank the gradient of its own positions and
nothing else, which is right because every rank of the group then computes the *same* loss from
the same gathered tensors: each rank's parameter gradients hold its own tokens' share, and
Megatron sums the gradients over the data × context group (``calculate_per_token_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ContextSplit", "context_parallel_attention", "padded_length", "zigzag_positions"]


def zigzag_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """Global positions held by context-parallel ``rank`` of ``size``, in its local order:
    chunk ``rank`` then chunk ``2·size − 1 − rank`` of ``2·size`` equal chunks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} of size {size}")
    if length % (2 * size):
        raise ValueError(f"a sequence of {length} positions does not split into 2 × {size} equal chunks")
    c = length // (2 * size)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)])


def padded_length(seq_len: int, size: int, multiple: int = 1) -> int:
    """The length a row of ``seq_len`` positions is right-padded to: a multiple of ``multiple``
    (sequence parallelism's tensor-parallel size) and, with ``size > 1``, of ``2 × size ×
    multiple`` (each rank's two chunks then split evenly over the tensor-parallel ranks)."""
    unit = multiple * (2 * size if size > 1 else 1)
    return -(-max(seq_len, 1) // unit) * unit


def _halves(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = x.shape[dim] // 2
    return x.narrow(dim, 0, c), x.narrow(dim, c, c)


def _order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Rank-ordered local tensors -> the whole sequence in position order."""
    size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for j, p in enumerate(parts):
        chunks[j], chunks[2 * size - 1 - j] = _halves(p, dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ContextSplit:
    """The context-parallel split of one micro-batch on this rank (see the module docstring)."""

    size: int
    rank: int
    group: Any
    """The context-parallel process group (``None`` with ``size == 1``)."""
    length: int
    """The whole (padded) sequence length ``L``; a multiple of ``2 × size`` when ``size > 1``."""

    def __post_init__(self) -> None:
        if self.size > 1:
            zigzag_positions(self.length, self.size, self.rank)  # validates

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.size)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of ``x`` (length ``L`` along ``dim``), in local order."""
        if x.shape[dim] != self.length:
            raise ValueError(f"split: dimension {dim} has {x.shape[dim]} positions, the split is of {self.length}")
        if self.size == 1:
            return x
        c, r = self.chunk, self.rank
        return torch.cat([x.narrow(dim, r * c, c), x.narrow(dim, (2 * self.size - 1 - r) * c, c)], dim=dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence ``[.., L, ..]`` from every rank's local ``x``, the same on every rank
        of the group. Backward: the gradient of this rank's positions (every rank must compute
        the same function of the result; module docstring)."""
        if self.size == 1:
            return x
        return _GatherReplicated.apply(x, self, dim)


def _all_gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split: ContextSplit, dim: int) -> torch.Tensor:
        ctx.split, ctx.dim = split, dim
        return _order(_all_gather(x, split.group), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.split.split(grad, ctx.dim).contiguous(), None, None


class _GatherSummed(torch.autograd.Function):
    """All-gather along dim 0 whose consumers differ per rank (each rank's queries use every
    rank's keys): the backward sums every rank's gradient of this rank's positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
        ctx.split = split
        return _order(_all_gather(x, split.group), 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split = ctx.split
        # rank-major order (rank j's positions, in its local order, for every j), then summed
        # over the group with each rank keeping its own block
        ranked = torch.cat([ContextSplit(split.size, j, split.group, split.length).split(grad, 0)
                            for j in range(split.size)], dim=0)
        return _reduce_scatter(ranked.contiguous(), split.group), None


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over the group; this rank keeps block ``rank`` of its equal blocks along dim 0."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)  # gloo has no reduce-scatter
    return x.chunk(size, dim=0)[rank].clone()


def context_parallel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit, *,
    scale: float | None = None, dropout_p: float = 0.0, enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    ``query`` ``[2c, b, heads, d]``, ``key``/``value`` ``[2c, b, groups, d]``: this rank's
    positions in local order (Megatron's sequence-first layout). Returns ``[b, heads, 2c, d]``
    (SDPA's layout), what causal attention over the whole sequence gives at these positions."""
    from torch.nn.attention.bias import causal_lower_right

    if split.size == 1:
        raise ValueError("context_parallel_attention needs a context-parallel split of size > 1")
    c = split.chunk
    if query.shape[0] != 2 * c or key.shape[0] != 2 * c or value.shape[0] != 2 * c:
        raise ValueError(f"expected {2 * c} local positions, got query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}")
    # keys and values in one all-gather (and one reduce-scatter back):
    # [2c, b, g, dk + dv] -> [L, b, g, dk + dv] in position order -> [b, g, L, d] each
    kv = _GatherSummed.apply(torch.cat((key, value), dim=-1), split)
    k, v = (t.permute(1, 2, 0, 3) for t in kv.split((key.shape[-1], value.shape[-1]), dim=-1))
    q = query.permute(1, 2, 0, 3)
    outs = []
    for half, index in enumerate((split.rank, 2 * split.size - 1 - split.rank)):
        end = (index + 1) * c  # this chunk's queries see keys [0, end): the last c of them causally
        outs.append(F.scaled_dot_product_attention(
            q[:, :, half * c : (half + 1) * c], k[:, :, :end], v[:, :, :end],
            attn_mask=causal_lower_right(c, end), dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
        ))
    return torch.cat(outs, dim=2)
