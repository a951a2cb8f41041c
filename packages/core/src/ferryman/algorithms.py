"""RL algorithm building blocks: advantage estimators, policy/value losses, KL penalties and
rollout importance-sampling correction. Plain torch functions, no state.

Conventions (shared with :mod:`ferryman.batch`):

* Every per-token tensor is ``[B, T]`` and aligned with ``input_ids``: position ``t`` describes
  token ``t`` (its log-prob is ``log p(token_t | tokens_<t)``).
* ``mask`` is a float or bool ``[B, T]`` tensor with 1 on the tokens the policy generated (the
  trained tokens) and 0 on prompt, observation/tool and padding tokens. Values of other tensors
  at mask-0 positions are ignored (they may be anything, even ``inf``/``nan`` for the masked
  reductions), and per-token outputs are 0 there unless stated otherwise.
* Metrics are returned as plain python floats.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "IS_LEVELS",
    "masked_sum",
    "masked_mean",
    "masked_whiten",
    "agg_loss",
    "agg_units",
    "log_probs_from_logits",
    "entropy_from_logits",
    "lean_log_probs_from_logits",
    "lean_entropy_from_logits",
    "token_rewards_from_scores",
    "compute_gae",
    "compute_grpo_advantages",
    "ppo_policy_loss",
    "ActorLossSettings",
    "actor_objective",
    "value_loss",
    "kl_penalty",
    "rollout_is_weights",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
ISLevel = Literal["none", "token", "sequence"]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")

_LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` so that ratios stay finite."""

Dim = int | tuple[int, ...] | None


# --------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a floating tensor of ``like``'s dtype (float32 if ``like`` is not floating)."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return mask.to(dtype=dtype, device=like.device)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dimensions when ``None``).

    Positions where ``mask == 0`` contribute exactly 0, even if ``x`` holds ``inf``/``nan``
    there. A float mask acts as per-element weights.
    """
    m = _float_mask(mask, x)
    prod = torch.where(m != 0, x * m, torch.zeros((), dtype=m.dtype, device=x.device))
    if dim is None:
        return prod.sum()
    return prod.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, eps: float = 1e-8
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set, along ``dim`` (all when ``None``).

    ``masked_sum(x, mask, dim) / max(mask.sum(dim), eps)``: an empty mask gives 0 (not nan).
    """
    m = _float_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp_min(eps)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to zero mean / unit variance over the masked positions (all rows together).

    Uses the unbiased variance (Bessel's correction, like ``torch.std``); with fewer than two
    masked elements the variance is taken as 0. ``(x - mean) / sqrt(var + eps)``, then the mean
    is added back if ``shift_mean`` is False (scale only). Positions where ``mask == 0`` are 0
    in the output.
    """
    m = _float_mask(mask, x)
    mean = masked_mean(x, m, eps=eps)
    centered = x - mean
    n = m.sum()
    sq = masked_sum(centered * centered, m)
    var = torch.where(n > 1, sq / (n - 1).clamp_min(eps), torch.zeros_like(sq))
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m != 0, out, torch.zeros((), dtype=out.dtype, device=out.device))


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, run_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:

    * ``"token-mean"``: sum over all masked tokens / number of masked tokens (DAPO token-level
      aggregation: every token weighs the same, long answers are not down-weighted).
    * ``"seq-mean-token-sum"``: per-row sum over its masked tokens, then the mean over rows with
      at least one masked token.
    * ``"seq-mean-token-mean"``: per-row mean over its masked tokens, then the mean over rows
      with at least one masked token (GRPO's original aggregation).

    An all-zero mask gives 0 (still connected to the graph of ``loss_mat``).

    ``run_tokens`` (``[B]``, optional): for the seq-mean modes, the masked tokens of each row's
    whole agent run, when a run is split over several rows (segments, see
    ``TrainBatch.run_tokens``). The unit averaged over is then the run, not the row: a run's
    loss is the sum (``seq-mean-token-sum``) or the mean (``seq-mean-token-mean``) over all of
    its rows' masked tokens, and each row counts as ``row tokens / run tokens`` of a unit, so
    that the rows of a run add up to one. Written as ``sum_r c_r * sum_t l_rt / sum_r u_r``
    (``c_r = 1`` or ``1 / run_tokens_r``, ``u_r = row tokens / run_tokens_r``), the result stays
    exact when the rows of a run are split over micro-batches weighted by their units. With
    ``run_tokens`` equal to each row's own token count this is the per-row formula.
    ``token-mean`` ignores it (a generated token is in exactly one segment).

    Raises:
        ValueError: unknown ``mode``.
    """
    m = _float_mask(mask, loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        seq = masked_sum(loss_mat, m, dim=-1)
        count = m.sum(dim=-1)
        if run_tokens is not None:
            run = run_tokens.to(device=seq.device, dtype=seq.dtype).clamp_min(1e-8)
            units = torch.where(count > 0, count / run, torch.zeros_like(count))
            if mode == "seq-mean-token-mean":
                seq = seq / run
            total = units.sum()
            return seq.sum() / torch.where(total > 0, total, torch.ones_like(total))
        if mode == "seq-mean-token-mean":
            seq = seq / count.clamp_min(1e-8)
        has_tokens = (count > 0).to(seq.dtype)
        return masked_sum(seq, has_tokens) / has_tokens.sum().clamp_min(1.0)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")


def agg_units(mask: torch.Tensor, mode: str, run_tokens: torch.Tensor | None = None) -> float:
    """The units :func:`agg_loss` averages over in a (micro-)batch: masked tokens for
    ``token-mean``; for the seq-mean modes, rows with at least one masked token, or with
    ``run_tokens`` each row's ``row tokens / run tokens`` of its run. A trainer that splits a
    mini-batch into micro-batches weighs micro-batch ``i``'s loss by ``units_i / sum(units)``:
    the weighted sum then equals :func:`agg_loss` of the whole mini-batch.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")
    count = mask.double().sum(-1)
    if mode == "token-mean":
        return float(count.sum().item())
    if run_tokens is None:
        return float((count > 0).sum().item())
    run = run_tokens.double().clamp_min(1e-8)
    return float(torch.where(count > 0, count / run, torch.zeros_like(count)).sum().item())


# --------------------------------------------------------------------------------------------
# logits → per-token quantities
# --------------------------------------------------------------------------------------------


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[b, t, labels[b, t]]`` as a ``[B, T]`` float32 tensor (float64 for
    float64 logits).

    No shifting happens here: ``logits[:, t]`` must already be the distribution that
    ``labels[:, t]`` was drawn from. With a causal LM whose output at position ``t`` predicts
    token ``t + 1``, the caller passes ``logits[:, :-1]`` and ``input_ids[:, 1:]`` and writes the
    result into positions ``1..T-1`` of a ``[B, T]`` tensor (position 0 is never trained).

    Computed as ``logits[label] - logsumexp(logits)`` in float32, which is stable and avoids
    materialising a second ``[B, T, V]`` log-softmax tensor.
    """
    lf = logits.to(_work_dtype(logits))
    picked = lf.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(lf, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` along the last axis: ``[B, T, V] -> [B, T]`` (float32;
    float64 for float64 logits).

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, which never takes the log of a
    (possibly underflowed) probability and so stays finite for very peaked or huge logits;
    ``-inf`` logits (banned tokens) contribute 0.
    """
    lf = logits.to(_work_dtype(logits))
    lse = torch.logsumexp(lf, dim=-1)
    probs = torch.softmax(lf, dim=-1)
    # 0 * -inf would be nan: tokens with zero probability (e.g. -inf-masked logits) add nothing
    zero = torch.zeros((), dtype=lf.dtype, device=lf.device)
    p_times_z = torch.where(probs > 0, probs * lf, zero)
    return lse - p_times_z.sum(dim=-1)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or the tensor's own dtype when it is wider (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _row_chunks(shape: torch.Size, chunk_tokens: int):
    """``(b, start, end)`` spans that cover a ``[B, T, V]`` tensor ``chunk_tokens`` positions at a
    time; each ``x[b, start:end]`` is a view (no copy) even when ``x`` is a slice of a larger
    tensor such as ``logits[:, :-1]``."""
    batch, length = int(shape[0]), int(shape[1])
    for b in range(batch):
        for start in range(0, length, chunk_tokens):
            yield b, start, min(start + chunk_tokens, length)


class _LeanLogProbs(torch.autograd.Function):
    """``log_softmax(logits)[label]`` computed ``chunk_tokens`` positions at a time in float32
    (float64 for float64 logits), saving only the input logits (in their own dtype) and one float32 log-sum-exp per position
    for the backward, which recomputes the softmax chunk by chunk: the float32 ``[B, T, V]``
    copies of the plain formula are never made."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        out = torch.empty(labels.shape, dtype=_work_dtype(logits), device=logits.device)
        lse_all = torch.empty_like(out)
        for b, s, e in _row_chunks(logits.shape, chunk_tokens):
            lf = logits[b, s:e].to(out.dtype)
            lse = torch.logsumexp(lf, dim=-1)
            picked = lf.gather(-1, labels[b, s:e].long().unsqueeze(-1)).squeeze(-1)
            out[b, s:e] = picked - lse
            lse_all[b, s:e] = lse
        ctx.save_for_backward(logits, labels, lse_all)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse_all = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.to(lse_all.dtype)
        for b, s, e in _row_chunks(logits.shape, ctx.chunk_tokens):
            g = grad_out[b, s:e]
            # d(picked - lse)/dz = onehot(label) - softmax(z)
            chunk = torch.exp(logits[b, s:e].to(lse_all.dtype) - lse_all[b, s:e].unsqueeze(-1))
            chunk.mul_(g.unsqueeze(-1).neg())
            chunk.scatter_add_(-1, labels[b, s:e].long().unsqueeze(-1), g.unsqueeze(-1))
            grad[b, s:e] = chunk.to(grad.dtype)
        return grad, None, None


def lean_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 1024
) -> torch.Tensor:
    """:func:`log_probs_from_logits` for ``[B, T, V]`` logits with a memory bound: float32 work
    happens ``chunk_tokens`` positions at a time, forward and backward (a custom autograd
    function that saves the logits as they are and one log-sum-exp per position). Same values
    and gradients as the plain formula up to float32 rounding; the gradient comes back in the
    logits' dtype, as it would through ``logits.float()``. With a 152k vocabulary and 8k
    positions it avoids ~10 GiB of float32 temporaries."""
    if logits.dim() != 3:
        raise ValueError(f"lean_log_probs_from_logits: logits must be [B, T, V], got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"lean_log_probs_from_logits: labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"lean_log_probs_from_logits: chunk_tokens must be >= 1, got {chunk_tokens}")
    return _LeanLogProbs.apply(logits, labels, int(chunk_tokens))


@torch.no_grad()
def lean_entropy_from_logits(logits: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """:func:`entropy_from_logits` of ``[B, T, V]`` logits computed ``chunk_tokens`` positions
    at a time, without gradient (for the entropy metric; a trained entropy bonus needs the
    plain function)."""
    if logits.dim() != 3:
        raise ValueError(f"lean_entropy_from_logits: logits must be [B, T, V], got {tuple(logits.shape)}")
    out = torch.empty(logits.shape[:2], dtype=_work_dtype(logits), device=logits.device)
    for b, s, e in _row_chunks(logits.shape, max(1, int(chunk_tokens))):
        out[b, s:e] = entropy_from_logits(logits[b, s:e])
    return out


# --------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------


def token_rewards_from_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar score on the last position of that row where ``mask == 1``.

    ``scores`` is ``[B]``, ``mask`` is ``[B, T]``; the result is a float ``[B, T]`` tensor that
    is 0 everywhere else. Rows without any masked position are all zeros.
    """
    present = mask != 0
    B, T = present.shape
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    out = torch.zeros((B, T), dtype=dtype, device=scores.device)
    if T == 0:
        return out
    positions = torch.arange(1, T + 1, device=present.device).expand(B, T)
    last_plus_one = torch.where(present, positions, torch.zeros_like(positions)).amax(dim=-1)
    has_any = last_plus_one > 0
    rows = torch.nonzero(has_any, as_tuple=True)[0]
    out[rows, last_plus_one[rows] - 1] = scores.to(dtype)[rows]
    return out


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the trained tokens of each row.

    The positions where ``mask == 1`` of a row are treated, in order, as consecutive steps of
    one episode; mask-0 positions (prompt, observation/tool output, padding) are skipped. For
    step ``k`` at position ``t_k``::

        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]        (V after the last step = 0)
        A_k     = delta_k + gamma * lam * A_{k+1}

    Rewards and values at mask-0 positions are ignored (put rewards on trained tokens, e.g.
    with :func:`token_rewards_from_scores`). No whitening is applied.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, with ``returns = advantages + values`` on
        masked positions and both 0 where ``mask == 0``. Detached (computed without grad).
    """
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    r = token_rewards.to(dtype)
    v = values.to(dtype)
    present = mask != 0
    B, T = present.shape
    advantages = torch.zeros((B, T), dtype=dtype, device=v.device)
    next_value = torch.zeros(B, dtype=dtype, device=v.device)
    running = torch.zeros(B, dtype=dtype, device=v.device)
    for t in range(T - 1, -1, -1):
        on = present[:, t]
        v_t = torch.where(on, v[:, t], torch.zeros_like(next_value))
        r_t = torch.where(on, r[:, t], torch.zeros_like(next_value))
        delta = r_t + gamma * next_value - v_t
        candidate = delta + gamma * lam * running
        running = torch.where(on, candidate, running)
        next_value = torch.where(on, v_t, next_value)
        advantages[:, t] = torch.where(on, candidate, torch.zeros_like(candidate))
    zero = torch.zeros((), dtype=dtype, device=v.device)
    returns = torch.where(present, advantages + v, zero)
    return advantages, returns


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    run_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantages: each score relative to the other rollouts of its group.

    For row ``i`` in group ``g``: ``A_i = (s_i - mean_g) / (std_g + eps)`` when ``norm_by_std``,
    else ``s_i - mean_g`` (Dr. GRPO). ``std_g`` is the unbiased standard deviation (like
    ``torch.std``); a group of size 1 gets advantage 0, and so does a group whose scores are all
    equal. ``group_index`` may hold any integer ids (they need not be contiguous).

    ``run_index`` (``[B]``, optional): rows with the same id are segments of one agent run (see
    ``TrainBatch.run_index``). The group statistics then count each run once, with the mean of
    its rows' scores (segments carry the run's reward), and every segment gets its run's
    advantage.

    Returns:
        ``[B, T]`` float: ``A_i`` on the row's ``mask == 1`` tokens, 0 elsewhere. Detached.
    """
    s = scores.float() if not scores.is_floating_point() else scores
    B = s.shape[0]
    if B == 0:
        return torch.zeros(mask.shape, dtype=s.dtype, device=s.device)
    if run_index is not None:
        runs, row_run = torch.unique(run_index.to(s.device), return_inverse=True)
        R = runs.shape[0]
        if R < B:  # some rows share a run: one score per run, each run counted once
            n = torch.zeros(R, dtype=s.dtype, device=s.device).index_add_(0, row_run, torch.ones_like(s))
            run_score = torch.zeros(R, dtype=s.dtype, device=s.device).index_add_(0, row_run, s) / n
            run_group = torch.zeros(R, dtype=group_index.dtype, device=group_index.device).index_copy_(0, row_run.to(group_index.device), group_index)
            per_run = compute_grpo_advantages(run_score, run_group, torch.ones(R, 1, dtype=s.dtype, device=s.device), norm_by_std, eps)[:, 0]
            adv = per_run[row_run]
            m = _float_mask(mask, adv)
            zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
            return torch.where(m != 0, adv.unsqueeze(-1) * m, zero)
    _, inverse = torch.unique(group_index, return_inverse=True)
    G = int(inverse.max().item()) + 1
    def per_group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, inverse, x)

    count = per_group_sum(torch.ones_like(s))
    mean = per_group_sum(s) / count
    centered = s - mean[inverse]
    sq = per_group_sum(centered * centered)
    var = torch.where(count > 1, sq / (count - 1).clamp_min(1.0), torch.zeros_like(sq))
    adv = torch.where(count[inverse] > 1, centered, torch.zeros_like(centered))
    if norm_by_std:
        adv = adv / (var.sqrt()[inverse] + eps)
    m = _float_mask(mask, adv)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    return torch.where(m != 0, adv.unsqueeze(-1) * m, zero)


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    run_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate with decoupled clip range and dual clip.

    Per token::

        ratio   = exp(logp - old_logp)                      (log-ratio clamped to [-20, 20])
        pg1     = -A * ratio
        pg2     = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
        clipped = max(pg1, pg2)
        loss    = min(clipped, -A * clip_c)  if A < 0  else clipped     (dual clip)
        loss    = loss * is_weights                         (if given; treated as constants)

    then reduced with :func:`agg_loss` over ``mask``. ``clip_high > clip_low`` is DAPO's
    clip-higher. ``log_probs`` carries the gradient; the other tensors are constants.

    Metrics (floats, over masked tokens): ``pg_clipfrac`` (share where ``pg2 > pg1``, i.e. the
    clip is active), ``pg_clipfrac_lower`` (share where the dual clip bound applied),
    ``ppo_kl`` (mean of ``old_logp - logp``), ``ratio_mean``.
    """
    old = old_log_probs.detach()
    adv = advantages.detach()
    log_ratio = (log_probs - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    dual_bound = -adv * clip_c
    negative = adv < 0
    loss_mat = torch.where(negative, torch.minimum(clipped, dual_bound), clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = agg_loss(loss_mat, mask, agg, run_tokens)

    with torch.no_grad():
        m = _float_mask(mask, log_ratio)
        clip_active = (pg2 > pg1).to(m.dtype)
        dual_active = (negative & (clipped > dual_bound)).to(m.dtype)
        metrics = {
            "pg_clipfrac": float(masked_mean(clip_active, m).item()),
            "pg_clipfrac_lower": float(masked_mean(dual_active, m).item()),
            "ppo_kl": float(masked_mean(old - log_probs.detach(), m).item()),
            "ratio_mean": float(masked_mean(ratio.detach(), m).item()),
        }
    return loss, metrics


class ActorLossSettings(Protocol):
    """What :func:`actor_objective` reads (``ferryman.config.AlgorithmConfig`` has them)."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    kl_coef: float
    kl_type: str


def actor_objective(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    alg: ActorLossSettings,
    *,
    ref_log_probs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    run_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor loss of one (micro-)batch, the same for every trainer backend::

        loss = ppo_policy_loss(...) - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty)

    each term aggregated with ``alg.loss_agg_mode`` and ``run_tokens`` (:func:`agg_loss`).
    ``entropy`` (``[B, T]``, aligned like ``log_probs``) carries a gradient only when
    ``entropy_coeff != 0``; otherwise it is reported, detached. ``ref_log_probs`` is needed
    when ``kl_coef > 0``.

    Returns the loss and float metrics ``pg_loss``, ``kl_loss``, ``entropy``, ``pg_clipfrac``,
    ``ppo_kl``.

    Raises:
        ValueError: ``kl_coef > 0`` without ``ref_log_probs``.
    """
    agg = alg.loss_agg_mode
    pg_loss, pg_m = ppo_policy_loss(
        log_probs, old_log_probs, advantages, mask,
        clip_low=alg.clip_ratio_low, clip_high=alg.clip_ratio_high, clip_c=alg.clip_ratio_c,
        agg=agg, is_weights=is_weights, run_tokens=run_tokens,
    )
    loss = pg_loss
    if alg.entropy_coeff != 0:
        ent_loss = agg_loss(entropy, mask, agg, run_tokens)
        loss = loss - alg.entropy_coeff * ent_loss
    else:
        ent_loss = agg_loss(entropy.detach(), mask, agg, run_tokens)
    kl_value = 0.0
    if alg.kl_coef > 0:
        if ref_log_probs is None:
            raise ValueError("actor_objective: kl_coef > 0 needs ref_log_probs")
        kl_loss = agg_loss(kl_penalty(log_probs, ref_log_probs, alg.kl_type), mask, agg, run_tokens)
        loss = loss + alg.kl_coef * kl_loss
        kl_value = float(kl_loss.detach().item())
    return loss, {
        "pg_loss": float(pg_loss.detach().item()),
        "kl_loss": kl_value,
        "entropy": float(ent_loss.detach().item()),
        "pg_clipfrac": pg_m["pg_clipfrac"],
        "ppo_kl": pg_m["ppo_kl"],
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.5,
    agg: str = "token-mean",
    run_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value-function loss (PPO)::

        v_clip = clamp(v, old - clip, old + clip)
        loss   = 0.5 * max((v - R)^2, (v_clip - R)^2)

    reduced with :func:`agg_loss`. Metric ``vf_clipfrac``: share of masked tokens where the
    clipped term is the larger one (strictly).
    """
    old = old_values.detach()
    R = returns.detach()
    v_clip = old + (values - old).clamp(-clip, clip)
    unclipped_sq = (values - R) ** 2
    clipped_sq = (v_clip - R) ** 2
    loss_mat = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = agg_loss(loss_mat, mask, agg, run_tokens)
    with torch.no_grad():
        frac = masked_mean((clipped_sq > unclipped_sq).to(loss_mat.dtype), mask)
    return loss, {"vf_clipfrac": float(frac.item())}


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from sampled-token log-probs, ``[B, T]``.

    With ``d = logp - ref_logp``:

    * ``"k1"``: ``d`` (unbiased, high variance, can be negative);
    * ``"k2"``: ``0.5 * d^2``;
    * ``"k3"``: ``exp(-d) + d - 1`` (Schulman's unbiased non-negative estimator);
    * ``"low_var_kl"``: k3 with ``-d`` clamped to ``[-20, 20]`` before ``exp`` and the result
      clamped to ``[-10, 10]``.

    Not masked: callers aggregate with ``mask``.

    Raises:
        ValueError: unknown ``kind``.
    """
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        neg = -d
        return torch.exp(neg) - neg - 1.0
    if kind == "low_var_kl":
        neg = (-d).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl penalty kind {kind!r}; allowed: {', '.join(KL_KINDS)}")


# --------------------------------------------------------------------------------------------
# rollout (behaviour policy) importance sampling
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``pi_old / pi_rollout`` correcting the trainer/engine mismatch.

    ``old_log_probs`` come from the trainer's recompute, ``rollout_log_probs`` from the inference
    engine that sampled the tokens (the behaviour policy).

    * ``level="token"``: ``w_t = exp(old_t - rollout_t)`` per token.
    * ``level="sequence"``: ``w = exp(sum_t mask_t * (old_t - rollout_t))``, the same for every
      token of the row.
    * ``level="none"``: ``w = 1``.

    Weights are truncated from above at ``threshold`` (TIS), computed in log space (the log
    weight is clamped to ``[-20, log(threshold)]`` before ``exp``, so nothing overflows), and
    are 0 where ``mask == 0``. The result is detached.

    Metrics (floats): ``rollout_is/mean`` and ``rollout_is/max`` describe the weights *before*
    truncation (log clamped to ``[-20, 20]``), ``rollout_is/truncated_frac`` the share that was
    truncated; the unit is a masked token for ``"token"`` and a row with at least one masked
    token for ``"sequence"`` (for ``"none"``: 1, 1 and 0). ``rollout_is/mismatch_kl`` is the
    masked mean over tokens of ``rollout - old`` (k1 estimate of ``KL(rollout || old)``), for
    every level.

    Raises:
        ValueError: unknown ``level`` or ``threshold <= 0``.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; allowed: {', '.join(IS_LEVELS)}")
    if not threshold > 0:
        raise ValueError(f"rollout IS threshold must be > 0, got {threshold}")
    old = old_log_probs.detach().float()
    rollout = rollout_log_probs.detach().float()
    m = _float_mask(mask, old)
    present = m != 0
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    log_w = torch.where(present, old - rollout, zero)
    mismatch_kl = float(masked_mean(-log_w, m).item())
    log_threshold = math.log(threshold)

    if level == "none":
        weights = torch.where(present, torch.ones_like(old), zero)
        return weights, {
            "rollout_is/mean": 1.0,
            "rollout_is/max": 1.0,
            "rollout_is/truncated_frac": 0.0,
            "rollout_is/mismatch_kl": mismatch_kl,
        }

    if level == "token":
        unit_log_w = log_w
        unit_present = present
        applied_log = log_w.clamp(-_LOG_RATIO_CLAMP, log_threshold)
        weights = torch.where(present, torch.exp(applied_log), zero)
    else:  # sequence
        unit_log_w = log_w.sum(dim=-1)
        unit_present = present.any(dim=-1)
        applied_log = unit_log_w.clamp(-_LOG_RATIO_CLAMP, log_threshold)
        weights = torch.where(present, torch.exp(applied_log).unsqueeze(-1).expand_as(old), zero)

    raw = torch.exp(unit_log_w.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    unit_mask = unit_present.to(old.dtype)
    n_units = int(unit_present.sum().item())
    truncated = (unit_log_w > log_threshold).to(old.dtype)
    metrics = {
        "rollout_is/mean": float(masked_mean(raw, unit_mask).item()),
        "rollout_is/max": float(raw[unit_present].max().item()) if n_units else 0.0,
        "rollout_is/truncated_frac": float(masked_mean(truncated, unit_mask).item()),
        "rollout_is/mismatch_kl": mismatch_kl,
    }
    return weights, metrics
