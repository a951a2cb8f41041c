"""Tests for ferryman.algorithms against numbers worked out by hand (see the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from ferryman.algorithms import (
    actor_objective,
    agg_loss,
    agg_units,
    compute_gae,
    compute_grpo_advantages,
    entropy_from_logits,
    kl_penalty,
    lean_entropy_from_logits,
    lean_log_probs_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    ppo_policy_loss,
    rollout_is_weights,
    token_rewards_from_scores,
    value_loss,
)

LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    """``actual`` equals the hand-written ``expected`` within ``atol`` (shape included)."""
    # (plain torch.allclose: torch.testing.assert_close costs seconds on its first call)
    exp = torch.tensor(expected, dtype=torch.float32)
    got = actual.detach().float()
    assert got.shape == exp.shape, f"shape {tuple(got.shape)} != expected {tuple(exp.shape)}"
    assert torch.allclose(got, exp, atol=atol, rtol=0.0), f"got\n{got}\nexpected\n{exp}"


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    close(masked_sum(x, mask), 4.0)
    close(masked_sum(x, mask, dim=-1), [4.0, 0.0])
    close(masked_sum(x, mask, dim=0), [1.0, 0.0, 3.0])
    close(masked_mean(x, mask), 2.0)
    # second row has no tokens: 0, not nan
    close(masked_mean(x, mask, dim=-1), [2.0, 0.0])
    close(masked_mean(x, torch.zeros_like(x)), 0.0)


def test_masked_reductions_ignore_inf_and_nan_outside_mask() -> None:
    x = torch.tensor([[1.0, float("inf"), float("nan"), 3.0]])
    mask = torch.tensor([[True, False, False, True]])
    close(masked_sum(x, mask), 4.0)
    close(masked_mean(x, mask), 2.0)


def test_masked_whiten() -> None:
    # masked values 2, 4, 6: mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    x = torch.tensor([[2.0, 4.0], [6.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    close(masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]], atol=1e-4)
    # scale only: (x - 4) / 2 + 4
    close(masked_whiten(x, mask, shift_mean=False), [[3.0, 4.0], [5.0, 0.0]], atol=1e-4)


def test_masked_whiten_single_and_equal_values() -> None:
    close(masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1.0, 0.0]])), [[0.0, 0.0]])
    close(masked_whiten(torch.full((2, 2), 3.0), torch.ones(2, 2)), [[0.0, 0.0], [0.0, 0.0]])
    close(masked_whiten(torch.ones(1, 3), torch.zeros(1, 3)), [[0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- agg_loss


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [5.0, 5.0, 5.0, 5.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_agg_loss_modes_differ_on_unequal_lengths() -> None:
    # tokens: 1+2+3+4+10+20 = 40 over 6 tokens
    close(agg_loss(LOSS, LOSS_MASK, "token-mean"), 40.0 / 6.0)
    # rows with tokens: sums 10 and 30 -> 20 (third row is empty and excluded)
    close(agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum"), 20.0)
    # rows: means 2.5 and 15 -> 8.75
    close(agg_loss(LOSS, LOSS_MASK, "seq-mean-token-mean"), 8.75)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_empty_mask_is_zero_with_grad(mode: str) -> None:
    x = LOSS.clone().requires_grad_(True)
    out = agg_loss(x, torch.zeros_like(LOSS), mode)
    assert out.item() == 0.0
    out.backward()
    assert x.grad is not None and torch.all(x.grad == 0)


def test_agg_loss_token_mean_gradient() -> None:
    x = LOSS.clone().requires_grad_(True)
    agg_loss(x, LOSS_MASK, "token-mean").backward()
    assert x.grad is not None
    s = 1.0 / 6.0
    close(x.grad, [[s, s, s, s], [s, s, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_agg_loss_bool_mask() -> None:
    close(agg_loss(LOSS, LOSS_MASK.bool(), "seq-mean-token-mean"), 8.75)


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum.*seq-mean-token-mean"):
        agg_loss(LOSS, LOSS_MASK, "sum")


# ---------------------------------------------------------------- logits


def test_log_probs_from_logits() -> None:
    # softmax([0, 0, ln2]) = [1/4, 1/4, 1/2]
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 0], [1, 2]])
    close(
        log_probs_from_logits(logits, labels),
        [[-0.6931472, -1.3862944], [-1.0986123, -1.0986123]],
    )


def test_log_probs_from_logits_large_and_bf16() -> None:
    logits = torch.tensor([[[1000.0, 1000.0, 1000.0 + LN2]]])
    close(log_probs_from_logits(logits, torch.tensor([[0]])), [[-1.3862944]])
    bf16 = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    out = log_probs_from_logits(bf16, torch.tensor([[3]]))
    assert out.dtype == torch.float32
    close(out, [[-1.3862944]])


def test_entropy_from_logits() -> None:
    logits = torch.tensor(
        [
            [[0.0, 0.0, LN2, -math.inf], [0.0, 0.0, 0.0, 0.0]],
            [[1e4, 0.0, 0.0, 0.0], [500.0, 500.0, 500.0 + LN2, -math.inf]],
        ]
    )
    # [1/4, 1/4, 1/2, 0]: 1.5 ln2 = 1.0397208; uniform over 4: ln4; one-hot: 0
    close(
        entropy_from_logits(logits),
        [[1.0397208, 1.3862944], [0.0, 1.0397208]],
        atol=1e-4,
    )


def test_lean_log_probs_match_hand_values_and_the_plain_formula() -> None:
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 0], [1, 2]])
    # chunks of 1 position: every (row, position) its own chunk
    close(
        lean_log_probs_from_logits(logits, labels, chunk_tokens=1),
        [[-0.6931472, -1.3862944], [-1.0986123, -1.0986123]],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_lean_log_probs_gradients_equal_the_plain_ones(dtype, chunk) -> None:
    """Values and gradients of the chunked autograd function equal those of the plain formula,
    on a slice ``logits[:, :-1]`` of a larger tensor (the trainer's case) with -inf (banned)
    logits, for chunk sizes that divide the length, do not, and exceed it."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 8, 50, generator=g) * 4).to(dtype)
    base[0, 2, 7] = -math.inf
    labels = torch.randint(0, 50, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)

    def run(fn):
        leaf = base.clone().requires_grad_(True)
        out = fn(leaf[:, :-1], labels)
        (out * weights).sum().backward()
        return out.detach(), leaf.grad

    lean_out, lean_grad = run(lambda x, y: lean_log_probs_from_logits(x, y, chunk_tokens=chunk))
    ref_out, ref_grad = run(log_probs_from_logits)
    assert lean_out.dtype == torch.float32 and lean_grad.dtype == dtype
    torch.testing.assert_close(lean_out, ref_out, rtol=1e-6, atol=1e-5)
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(lean_grad, ref_grad, **tol)
    assert torch.all(lean_grad[:, -1] == 0)  # the last position is not part of the slice


def test_lean_entropy_equals_the_plain_one() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, 30, generator=g) * 3
    logits[1, 4, :5] = -math.inf
    torch.testing.assert_close(
        lean_entropy_from_logits(logits, chunk_tokens=4), entropy_from_logits(logits), rtol=1e-6, atol=1e-6
    )


def test_lean_functions_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"must be \[B, T, V\]"):
        lean_log_probs_from_logits(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        lean_log_probs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        lean_log_probs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 4, dtype=torch.long), chunk_tokens=0)


# ---------------------------------------------------------------- token rewards


def test_token_rewards_from_scores() -> None:
    mask = torch.tensor(
        [[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]
    )
    scores = torch.tensor([1.5, -2.0, 7.0, 3.0])
    out = token_rewards_from_scores(scores, mask.float())
    close(
        out,
        [
            [0.0, 0.0, 0.0, 0.0, 1.5, 0.0],
            [0.0, -2.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],
        ],
    )
    assert torch.equal(token_rewards_from_scores(scores, mask.bool()), out)


# ---------------------------------------------------------------- GAE


def test_gae_two_rows_with_skipped_observation_token() -> None:
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # row 0: prompt at 0, generated 1-2, tool observation at 3 (skipped), generated 4
    # row 1: generated 0-1, padding after
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 7.0, 0.2], [0.3, 0.6, 5.0, 5.0, 5.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 3.0, 1.0], [0.5, -1.0, 0.0, 0.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # row 0, steps at positions 4, 2, 1 (backwards); the reward 3.0 and value 7.0 at the
    # observation token are ignored:
    #   pos 4: delta = 1 + 0.9*0 - 0.2 = 0.8                    A = 0.8
    #   pos 2: delta = 0 + 0.9*0.2 - 0.4 = -0.22                A = -0.22 + 0.72*0.8 = 0.356
    #   pos 1: delta = 0 + 0.9*0.4 - 0.5 = -0.14                A = -0.14 + 0.72*0.356 = 0.11632
    # row 1:
    #   pos 1: delta = -1 + 0 - 0.6 = -1.6                      A = -1.6
    #   pos 0: delta = 0.5 + 0.9*0.6 - 0.3 = 0.74               A = 0.74 + 0.72*(-1.6) = -0.412
    close(adv, [[0.0, 0.11632, 0.356, 0.0, 0.8], [-0.412, -1.6, 0.0, 0.0, 0.0]])
    close(ret, [[0.0, 0.61632, 0.756, 0.0, 1.0], [-0.112, -1.0, 0.0, 0.0, 0.0]])


def test_gae_gamma_lam_one_is_monte_carlo() -> None:
    # A_t = (sum of future rewards) - V_t = 1 - V_t; returns = 1 everywhere
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, -3.0, -3.0, 0.2]])
    rewards = token_rewards_from_scores(torch.tensor([1.0]), mask)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    close(adv, [[0.5, 0.6, 0.0, 0.0, 0.8]])
    close(ret, [[1.0, 1.0, 0.0, 0.0, 1.0]])


def test_gae_lam_zero_is_one_step_td() -> None:
    # A_t = r_t + gamma * V_next - V_t with gamma 0.5: [0 + 0.5*0.4 - 0.5, 2 + 0 - 0.4]
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 9.0, 0.4]])
    adv, _ = compute_gae(rewards, values, mask, 0.5, 0.0)
    close(adv, [[-0.3, 0.0, 1.6]])


def test_gae_empty_row_and_bool_mask() -> None:
    mask = torch.tensor([[False, False, False], [True, True, False]])
    values = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([[5.0, 5.0, 5.0], [0.0, 2.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, 0.5, 1.0)
    # row 1: pos 1 A = 2; pos 0: A = 0 + 0.5*0 - 0 + 0.5*2 = 1
    close(adv, [[0.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    close(ret, [[0.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    assert not adv.requires_grad


# ---------------------------------------------------------------- GRPO


def test_grpo_advantages_groups() -> None:
    # group 3: scores 1,0,1,1 -> mean 0.75, deviations .25,-.75,.25,.25,
    #          unbiased var = (3*.0625 + .5625)/3 = .25, std .5 -> .5, -1.5, .5, .5
    # group 7: single rollout -> 0
    # group 1: all equal -> 0
    # group 4: scores 0, 2 -> mean 1, std sqrt(2) -> -0.7071068, 0.7071068
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 5.0, 5.0, 0.0, 2.0])
    groups = torch.tensor([3, 3, 3, 3, 7, 1, 1, 4, 4])
    mask = torch.ones(9, 2)
    mask[0, 1] = 0.0
    out = compute_grpo_advantages(scores, groups, mask)
    expected_rows = [0.5, -1.5, 0.5, 0.5, 0.0, 0.0, 0.0, -0.7071068, 0.7071068]
    expected = [[a, a] for a in expected_rows]
    expected[0][1] = 0.0
    close(out, expected, atol=1e-5)


def test_grpo_advantages_without_std() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 5.0, 5.0, 0.0, 2.0])
    groups = torch.tensor([3, 3, 3, 3, 7, 1, 1, 4, 4])
    mask = torch.tensor([[0.0, 1.0, 1.0]]).expand(9, 3)
    out = compute_grpo_advantages(scores, groups, mask, norm_by_std=False)
    expected_rows = [0.25, -0.75, 0.25, 0.25, 0.0, 0.0, 0.0, -1.0, 1.0]
    close(out, [[0.0, a, a] for a in expected_rows])


def test_grpo_advantages_edge_cases() -> None:
    # every group of size 1, and a row with an all-zero mask
    out = compute_grpo_advantages(
        torch.tensor([3.0, -1.0]), torch.tensor([0, 1]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    )
    close(out, [[0.0, 0.0], [0.0, 0.0]])
    # all-equal rewards in one group: zero, no nan
    same = torch.full((4,), 0.5)
    out = compute_grpo_advantages(same, torch.zeros(4, dtype=torch.long), torch.ones(4, 3))
    assert torch.isfinite(out).all()
    close(out, [[0.0] * 3] * 4)


# ---------------------------------------------------------------- PPO policy loss


def _ppo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # five trained tokens (log ratio, advantage), clip 0.2, clip_c 3:
    #   a: ratio 1.5, A= 1: pg1 -1.5, pg2 -1.2 -> -1.2 (clipped)
    #   b: ratio 0.5, A= 1: pg1 -0.5, pg2 -0.8 -> -0.5
    #   c: ratio 0.5, A=-1: pg1  0.5, pg2  0.8 ->  0.8 (clipped; dual bound 3 not reached)
    #   d: ratio 4.0, A=-1: pg1  4.0, pg2  1.2 ->  4.0 -> dual clip min(4, 3) = 3
    #   e: ratio 1.0, A= 2: -2
    # plus one untrained position with an absurd log ratio
    log_ratio = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(0.5)], [math.log(4.0), 0.0, 50.0]]
    )
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -60.0]])
    return old + log_ratio, old, adv, mask


def test_ppo_policy_loss_clip_and_dual_clip() -> None:
    logp, old, adv, mask = _ppo_case()
    logp.requires_grad_(True)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask)
    # (-1.2 - 0.5 + 0.8 + 3 - 2) / 5 = 0.02
    close(loss, 0.02)
    assert metrics["pg_clipfrac"] == pytest.approx(0.4)  # a, c
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2)  # d
    # mean(old - logp) = -(ln1.5 + ln0.5 + ln0.5 + ln4 + 0)/5 = -ln(1.5)/5
    assert metrics["ppo_kl"] == pytest.approx(-0.0810930, abs=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(1.5, abs=1e-5)  # (1.5+.5+.5+4+1)/5
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # d(-A*ratio)/dlogp = -A*ratio on unclipped tokens (b: -0.5, e: -2), /5; clipped -> 0
    assert logp.grad is not None
    close(logp.grad, [[0.0, -0.1, 0.0], [0.0, -0.4, 0.0]])


def _settings(**kw):
    from ferryman.config import AlgorithmConfig

    return AlgorithmConfig(**kw)


def test_actor_objective_adds_entropy_and_kl_terms() -> None:
    logp, old, adv, mask = _ppo_case()
    logp.requires_grad_(True)
    # entropy 1 on every trained token of row 0, 3 on row 1 -> token-mean (3*1 + 2*3)/5 = 1.8
    ent = torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 9.0]], requires_grad=True)
    # reference log-probs equal to logp except token b (logp - ln2): k1 = logp - ref = ln2 there
    ref = (logp.detach() - torch.tensor([[0.0, LN2, 0.0], [0.0, 0.0, 0.0]])).clone()
    alg = _settings(entropy_coeff=0.1, kl_coef=0.5, kl_type="k1")
    loss, m = actor_objective(logp, ent, old, adv, mask, alg, ref_log_probs=ref)
    # pg 0.02 (test above) - 0.1 * 1.8 + 0.5 * (ln2 / 5)
    close(loss, 0.02 - 0.18 + 0.5 * LN2 / 5)
    assert m["pg_loss"] == pytest.approx(0.02, abs=1e-6)
    assert m["entropy"] == pytest.approx(1.8, abs=1e-6)
    assert m["kl_loss"] == pytest.approx(LN2 / 5, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(0.4) and set(m) == {"pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl"}
    loss.backward()
    # the entropy term's gradient: -0.1 / 5 on every trained token, 0 elsewhere
    close(ent.grad, [[-0.02, -0.02, -0.02], [-0.02, -0.02, 0.0]])


def test_actor_objective_without_entropy_coeff_reports_it_detached() -> None:
    logp, old, adv, mask = _ppo_case()
    ent = torch.ones(2, 3, requires_grad=True)
    loss, m = actor_objective(logp.requires_grad_(True), ent, old, adv, mask, _settings(kl_coef=0.0))
    close(loss, 0.02)
    assert m["entropy"] == pytest.approx(1.0) and m["kl_loss"] == 0.0
    loss.backward()
    assert ent.grad is None
    with pytest.raises(ValueError, match="ref_log_probs"):
        actor_objective(logp, ent, old, adv, mask, _settings(kl_coef=0.1))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("runs", [False, True])
def test_agg_units_weigh_micro_batches_to_the_whole_loss(mode: str, runs: bool) -> None:
    # rows 0+1 are one run split in two (3 + 2 tokens), row 2 is its own run, row 3 is empty
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    run_tokens = torch.tensor([5.0, 5.0, 1.0, 1.0]) if runs else None
    whole = agg_loss(loss, mask, mode, run_tokens)
    parts = [[0], [1, 3], [2]]
    units = [agg_units(mask[p], mode, None if run_tokens is None else run_tokens[p]) for p in parts]
    # hand values: token-mean 6 tokens; rows 3 (rows 0, 1, 2); runs 3/5 + 2/5 + 1 = 2
    assert sum(units) == pytest.approx({"token-mean": 6.0}.get(mode, 2.0 if runs else 3.0))
    total = sum(u / sum(units) * agg_loss(loss[p], mask[p], mode, None if run_tokens is None else run_tokens[p]) for u, p in zip(units, parts))
    close(total, float(whole))
    with pytest.raises(ValueError, match="aggregation"):
        agg_units(mask, "sum")


def test_ppo_policy_loss_clip_higher() -> None:
    # ratio 1.5 and 1.25 with A = 1, clip_low 0.2
    logp = torch.tensor([[math.log(1.5), math.log(1.25)]])
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    loss, m = ppo_policy_loss(logp, old, adv, mask)
    close(loss, (-1.2 - 1.2) / 2)
    assert m["pg_clipfrac"] == pytest.approx(1.0)
    loss, m = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, (-1.28 - 1.25) / 2)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    # decoupled lower bound: ratio 0.7, A = -1: clip_low 0.2 -> pg2 0.8, clip_low 0.4 -> 0.7
    lp, zero = torch.tensor([[math.log(0.7)]]), torch.zeros(1, 1)
    neg, one = -torch.ones(1, 1), torch.ones(1, 1)
    loss, _ = ppo_policy_loss(lp, zero, neg, one)
    close(loss, 0.8)
    loss, _ = ppo_policy_loss(lp, zero, neg, one, clip_low=0.4)
    close(loss, 0.7)


def test_ppo_policy_loss_is_weights_and_agg() -> None:
    logp, old, adv, mask = _ppo_case()
    logp.requires_grad_(True)
    w = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 7.0]], requires_grad=True)
    loss, _ = ppo_policy_loss(logp, old, adv, mask, is_weights=w)
    # (-2.4 - 0.5 + 0.8 + 1.5 - 2) / 5 = -0.52
    close(loss, -0.52)
    loss.backward()
    assert w.grad is None
    # seq-mean-token-mean without weights: row means (-1.2-0.5+0.8)/3 = -0.3, (3-2)/2 = 0.5 -> 0.1
    loss, _ = ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    close(loss, 0.1)
    # seq-mean-token-sum: (-0.9 + 1.0) / 2 = 0.05
    loss, _ = ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum")
    close(loss, 0.05)


def test_ppo_policy_loss_on_policy_and_empty() -> None:
    # ratio 1 everywhere: loss = -mean(A) over mask = -(1 + 3)/2
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    loss, m = ppo_policy_loss(logp, logp.clone(), adv, torch.tensor([[1.0, 1.0, 0.0]]))
    close(loss, -2.0)
    assert m["pg_clipfrac"] == 0.0 and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    loss, m = ppo_policy_loss(logp, logp.clone(), torch.ones(1, 3), torch.zeros(1, 3))
    assert loss.item() == 0.0 and m["ratio_mean"] == 0.0


# ---------------------------------------------------------------- value loss


def test_value_loss() -> None:
    # clip 0.5:
    #   v 1.0, old 0, R 2: v_clip 0.5 -> max(1, 2.25) -> 1.125 (clip term larger)
    #   v 0.2, old 0, R 1: v_clip 0.2 -> 0.64 -> 0.32
    #   v 3.0, old 0, R 0: v_clip 0.5 -> max(9, 0.25) -> 4.5
    #   masked token ignored
    values = torch.tensor([[1.0, 0.2], [3.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0], [0.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask)
    close(loss, (1.125 + 0.32 + 4.5) / 3)
    assert m["vf_clipfrac"] == pytest.approx(1.0 / 3.0)
    loss.backward()
    # grads /3: clipped token 0; (v-R) = -0.8 -> -0.8/3; (v-R) = 3 -> 1
    assert values.grad is not None
    close(values.grad, [[0.0, -0.8 / 3], [1.0, 0.0]])
    # seq-mean-token-mean: rows (1.125 + 0.32)/2 = 0.7225 and 4.5 -> 2.61125
    loss, _ = value_loss(values, old, returns, mask, agg="seq-mean-token-mean")
    close(loss, 2.61125)


# ---------------------------------------------------------------- KL penalty


def test_kl_penalty_kinds() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # d = logp - ref = [0.5, -1]
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    # exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818
    close(kl_penalty(logp, ref, "k3"), [[0.1065307, 0.7182818]])
    close(kl_penalty(logp, ref, "low_var_kl"), [[0.1065307, 0.7182818]])


def test_kl_penalty_low_var_clamped() -> None:
    logp = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[30.0, -30.0, -4.0]])
    # ref - logp = 30 -> k3 = e^30 - 31 (huge); -30 -> 29; -4 -> e^-4 + 3 = 3.0183156
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 0].item() > 1e12
    close(k3[0, 1:], [29.0, 3.0183156], atol=1e-4)
    close(kl_penalty(logp, ref, "low_var_kl"), [[10.0, 10.0, 3.0183156]], atol=1e-4)
    extreme = kl_penalty(torch.zeros(1, 1), torch.tensor([[1e4]]), "low_var_kl")
    close(extreme, [[10.0]])


def test_kl_penalty_unknown() -> None:
    with pytest.raises(ValueError, match="k1.*k2.*k3.*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------- rollout IS


def _is_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # old - rollout: row 0 [ln .5, ln 3, 0, (masked) 100], row 1 [ln 1.5, ln 1.2, masked, masked]
    rollout = torch.tensor([[-1.0, -2.0, -0.3, -200.0], [-0.4, -0.9, 0.0, 0.0]])
    diff = torch.tensor(
        [[math.log(0.5), math.log(3.0), 0.0, 100.0], [math.log(1.5), math.log(1.2), 5.0, -5.0]]
    )
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    return rollout + diff, rollout, mask


def test_rollout_is_token_level() -> None:
    old, rollout, mask = _is_case()
    w, m = rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    close(w, [[0.5, 2.0, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]])
    assert not w.requires_grad
    # raw weights .5, 3, 1, 1.5, 1.2: mean 7.2/5, max 3, 1 of 5 truncated
    assert m["rollout_is/mean"] == pytest.approx(1.44, abs=1e-5)
    assert m["rollout_is/max"] == pytest.approx(3.0, abs=1e-5)
    assert m["rollout_is/truncated_frac"] == pytest.approx(0.2)
    # mean(rollout - old) = -ln(.5 * 3 * 1 * 1.5 * 1.2)/5 = -ln(2.7)/5
    assert m["rollout_is/mismatch_kl"] == pytest.approx(-0.1986504, abs=1e-5)


def test_rollout_is_sequence_level() -> None:
    old, rollout, mask = _is_case()
    # row weights exp(ln(.5*3*1)) = 1.5 and exp(ln(1.5*1.2)) = 1.8
    w, m = rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    close(w, [[1.5, 1.5, 1.5, 0.0], [1.8, 1.8, 0.0, 0.0]])
    assert m["rollout_is/truncated_frac"] == 0.0
    w, m = rollout_is_weights(old, rollout, mask, level="sequence", threshold=1.6)
    close(w, [[1.5, 1.5, 1.5, 0.0], [1.6, 1.6, 0.0, 0.0]])
    assert m["rollout_is/mean"] == pytest.approx(1.65, abs=1e-5)
    assert m["rollout_is/max"] == pytest.approx(1.8, abs=1e-5)
    assert m["rollout_is/truncated_frac"] == pytest.approx(0.5)
    assert m["rollout_is/mismatch_kl"] == pytest.approx(-0.1986504, abs=1e-5)


def test_rollout_is_none_level() -> None:
    old, rollout, mask = _is_case()
    w, m = rollout_is_weights(old, rollout, mask, level="none")
    close(w, mask.tolist())
    assert m["rollout_is/mean"] == 1.0 and m["rollout_is/truncated_frac"] == 0.0
    assert m["rollout_is/mismatch_kl"] == pytest.approx(-0.1986504, abs=1e-5)


def test_rollout_is_no_overflow_and_empty() -> None:
    old = torch.tensor([[1000.0, -1000.0, 0.0]])
    rollout = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, m = rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    assert torch.isfinite(w).all()
    close(w, [[2.0, 0.0, 1.0]])
    assert all(math.isfinite(v) for v in m.values())
    w, m = rollout_is_weights(old, rollout, torch.tensor([[1.0, 0.0, 0.0]]), level="sequence")
    close(w, [[2.0, 0.0, 0.0]])
    w, m = rollout_is_weights(old, rollout, torch.zeros(1, 3), level="sequence")
    close(w, [[0.0, 0.0, 0.0]])
    assert m == {
        "rollout_is/mean": 0.0,
        "rollout_is/max": 0.0,
        "rollout_is/truncated_frac": 0.0,
        "rollout_is/mismatch_kl": 0.0,
    }


def test_rollout_is_bad_arguments() -> None:
    old, rollout, mask = _is_case()
    with pytest.raises(ValueError, match="none.*token.*sequence"):
        rollout_is_weights(old, rollout, mask, level="geometric")
    with pytest.raises(ValueError):
        rollout_is_weights(old, rollout, mask, threshold=0.0)
