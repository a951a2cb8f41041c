"""Per-token log-probs and entropies over vocab-parallel logits (plain torch.distributed).

With tensor parallelism Megatron's output layer leaves each of the ``tp`` ranks with the logits
of its own slice of the (padded) vocabulary, ``[B, T, V_pad / tp]``. A log-softmax over the whole
vocabulary then needs, per position, the global maximum (one ``all_reduce(MAX)``) and the global
sum of ``exp(z - max)`` (one ``all_reduce(SUM)``, together with the label's logit, which lives on
exactly one rank). The entropy ``H = lse - Σ p·z`` needs one more sum. No rank ever holds more
than its own shard, and, like core's :func:`ferryman.algorithms.lean_log_probs_from_logits`, the
float32 work is done ``chunk_tokens`` positions at a time, forward and backward: the backward
recomputes the softmax chunk by chunk from the saved (bf16) logits and one float32 log-sum-exp
and entropy per position, so no float32 copy of the logits shard exists at any time.

Vocabulary padding: columns whose global id is ``>= vocab_size`` are left out of the softmax (as
if their logit were -inf) and get zero gradient, so the result is the one of the unpadded HF
model whatever the padded rows hold.

The gradient with respect to the local logits needs no communication: for the log-prob of label
``y``, ``d/dz_j = [j = y] - p_j``; for the entropy, ``dH/dz_j = -p_j (z_j - Σ p·z)``; both are
local once ``lse`` and ``H`` are known. (The output layer's backward then all-reduces the input
gradient across the tensor-parallel group, as for any column-parallel linear.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs_and_entropy", "vocab_range"]


def vocab_range(padded_vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the global vocabulary ids held by tensor-parallel rank ``rank``."""
    per = padded_vocab // tp
    return rank * per, (rank + 1) * per


def _chunks(batch: int, length: int, chunk: int):
    for b in range(batch):
        for s in range(0, length, chunk):
            yield b, s, min(s + chunk, length)


def _reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, group, chunk_tokens, scale):
        B, T, V_local = logits.shape
        valid = max(0, min(V_local, vocab_size - vocab_start))
        lp = torch.empty((B, T), dtype=torch.float32, device=logits.device)
        lse_all = torch.empty_like(lp)
        ent = torch.empty_like(lp)
        for b, s, e in _chunks(B, T, chunk_tokens):
            n = e - s
            z = logits[b, s:e, :valid].float()
            if scale != 1.0:
                z = z * scale  # out of place: .float() of float32 logits is the input itself
            if valid:
                m = z.amax(dim=-1)
            else:
                m = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
            _reduce(m, dist.ReduceOp.MAX, group)
            ex = torch.exp(z - m.unsqueeze(-1))
            local = labels[b, s:e].long() - vocab_start
            mine = (local >= 0) & (local < valid)
            if valid:
                picked = z.gather(-1, local.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
                picked = torch.where(mine, picked, torch.zeros_like(picked))
            else:
                picked = torch.zeros((n,), dtype=torch.float32, device=logits.device)
            # sum of exp and the label's logit in one collective; then sum of exp·z
            sums = torch.stack([ex.sum(dim=-1), picked, (ex * z).sum(dim=-1)])
            _reduce(sums, dist.ReduceOp.SUM, group)
            lse = m + torch.log(sums[0])
            lp[b, s:e] = sums[1] - lse
            # Σ p·z = Σ exp(z - m)·z / Σ exp(z - m)
            ent[b, s:e] = lse - sums[2] / sums[0]
            lse_all[b, s:e] = lse
        ctx.save_for_backward(logits, labels, lse_all, ent)
        ctx.meta = (vocab_start, valid, chunk_tokens, scale)
        ctx.mark_non_differentiable(lse_all)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, labels, lse_all, ent = ctx.saved_tensors
        vocab_start, valid, chunk_tokens, scale = ctx.meta
        grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        if valid == 0:
            return grad, None, None, None, None, None, None
        B, T, _ = logits.shape
        for b, s, e in _chunks(B, T, chunk_tokens):
            z = logits[b, s:e, :valid].float()
            if scale != 1.0:
                z = z * scale  # out of place: .float() of float32 logits is the input itself
            lse = lse_all[b, s:e].unsqueeze(-1)
            p = torch.exp(z - lse)
            acc = torch.zeros_like(z)
            if g_lp is not None:
                g = g_lp[b, s:e].float()
                acc.sub_(p * g.unsqueeze(-1))
                local = labels[b, s:e].long() - vocab_start
                mine = (local >= 0) & (local < valid)
                acc.scatter_add_(-1, local.clamp(0, valid - 1).unsqueeze(-1), (g * mine).unsqueeze(-1))
            if g_ent is not None:
                gh = g_ent[b, s:e].float().unsqueeze(-1)
                expect_z = lse - ent[b, s:e].unsqueeze(-1)  # Σ p·z
                acc.sub_(gh * p * (z - expect_z))
            if scale != 1.0:
                acc.mul_(scale)
            grad[b, s:e, :valid] = acc.to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(labels), entropy)``, both ``[B, T]`` float32, of ``softmax(logits / temperature)``
    over the whole vocabulary, from this rank's ``[B, T, V_local]`` slice of it.

    ``logits[:, t]`` must be the distribution ``labels[:, t]`` was drawn from (shift before).
    ``vocab_start``: global id of local column 0 (:func:`vocab_range`); ``vocab_size``: the true
    vocabulary (ids at or beyond it are padding and left out; default: no padding). ``group``:
    the tensor-parallel process group (``None``: the logits are the whole vocabulary). Every
    rank of ``group`` must call it with the same ``labels``. Differentiable in ``logits``
    through both outputs; the gradient comes back in the logits' dtype."""
    if logits.dim() != 3:
        raise ValueError(f"vocab_parallel_log_probs_and_entropy: logits must be [B, T, V], got {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return _VocabParallelStats.apply(
        logits, labels, int(vocab_start), int(vocab_size), group, int(chunk_tokens), 1.0 / float(temperature)
    )
