"""An agent run returned as several segments counts once in a GRPO group: in the advantage
baseline and as a sequence of the seq-mean loss modes. Numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from ferryman.algorithms import agg_loss, compute_grpo_advantages
from ferryman.batch import build_train_batch, split_groups
from ferryman.types import Sample, Trajectory


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# one group of three runs: run A (score 1) came back as two segments, runs B and C (score 0)
SCORES = torch.tensor([1.0, 1.0, 0.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0])
RUNS = torch.tensor([7, 7, 3, 5])
MASK = torch.ones(4, 2)


def test_grpo_baseline_counts_a_run_once():
    # runs: 1, 0, 0 -> mean 1/3, deviations 2/3, -1/3, -1/3, unbiased var (4/9+1/9+1/9)/2 = 1/3,
    # std 0.5773503 -> A: 1.1547005 (both segments), B, C: -0.5773503
    out = compute_grpo_advantages(SCORES, GROUPS, MASK, run_index=RUNS)
    close(out, [[1.1547005] * 2, [1.1547005] * 2, [-0.5773503] * 2, [-0.5773503] * 2])
    # rows as runs (the old way) would give mean 0.5, std sqrt(1/3): +-0.8660254
    close(compute_grpo_advantages(SCORES, GROUPS, MASK), [[0.8660254] * 2] * 2 + [[-0.8660254] * 2] * 2)
    # Dr. GRPO: deviations from the run mean
    out = compute_grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False, run_index=RUNS)
    close(out, [[2 / 3] * 2, [2 / 3] * 2, [-1 / 3] * 2, [-1 / 3] * 2])


def test_grpo_run_index_of_single_rows_changes_nothing():
    scores = torch.tensor([1.0, 0.0, 1.0, 3.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([[1.0, 0.0]] * 5)
    plain = compute_grpo_advantages(scores, groups, mask)
    close(compute_grpo_advantages(scores, groups, mask, run_index=torch.arange(5)), plain.tolist())


def test_grpo_a_group_of_one_split_run_gets_zero():
    out = compute_grpo_advantages(torch.tensor([1.0, 1.0, 2.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1), run_index=torch.tensor([0, 0, 1, 2]))
    # group 0 holds one run (two segments): advantage 0; group 1: 2, 0 -> +-0.7071068
    close(out, [[0.0], [0.0], [0.7071068], [-0.7071068]])


# rows 0 and 1 are run A (4 + 2 masked tokens, sums 10 and 30), row 2 is run B (4 tokens, sum 20)
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [5.0, 5.0, 5.0, 5.0]])
LMASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
RUN_TOKENS = torch.tensor([6.0, 6.0, 4.0])


def test_seq_mean_modes_average_over_runs():
    # token-sum: run A 10 + 30 = 40, run B 20 -> 30 (per row it would be (10+30+20)/3 = 20)
    close(agg_loss(LOSS, LMASK, "seq-mean-token-sum", RUN_TOKENS), 30.0)
    # token-mean: run A 40/6, run B 20/4 = 5 -> (6.6666667 + 5)/2 = 5.8333333 (per row: 7.5)
    close(agg_loss(LOSS, LMASK, "seq-mean-token-mean", RUN_TOKENS), 35.0 / 6.0)
    # token-mean over all tokens is unchanged: a generated token is in exactly one segment
    close(agg_loss(LOSS, LMASK, "token-mean", RUN_TOKENS), 6.0)
    # each row its own run: the per-row formulas
    own = LMASK.sum(-1)
    close(agg_loss(LOSS, LMASK, "seq-mean-token-sum", own), 20.0)
    close(agg_loss(LOSS, LMASK, "seq-mean-token-mean", own), 7.5)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_split_runs_stay_exact_over_micro_batches(mode):
    # micro-batches {0, 2} and {1} split run A; weighted by their units (4/6 + 1 and 2/6 of 2)
    # they add up to the whole batch's loss, as a trainer accumulates them
    whole = agg_loss(LOSS, LMASK, mode, RUN_TOKENS)
    total_units = 2.0
    parts = []
    for rows, units in (([0, 2], 4 / 6 + 1), ([1], 2 / 6)):
        idx = torch.tensor(rows)
        parts.append(units / total_units * agg_loss(LOSS[idx], LMASK[idx], mode, RUN_TOKENS[idx]))
    close(sum(parts), float(whole))


def test_empty_rows_with_run_tokens():
    x = torch.ones(2, 3, requires_grad=True)
    out = agg_loss(x, torch.zeros(2, 3), "seq-mean-token-mean", torch.zeros(2))
    assert float(out) == 0.0 and out.requires_grad


def _traj(run_id, n_model: int, reward: float) -> Trajectory:
    t = Trajectory(request_id=run_id or "x", prompt_ids=[1, 2], reward=reward, run_id=run_id)
    t.response_ids = [3] * (n_model + 1)
    t.response_mask = [1] * n_model + [0]
    t.rollout_log_probs = [0.0] * (n_model + 1)
    t.token_versions = [0] * n_model + [-1]
    return t


def test_build_train_batch_indexes_runs():
    s0 = Sample(uid="a", task_index=0, trajectories=[_traj("r1", 3, 1.0), _traj("r1", 2, 1.0), _traj("r2", 4, 0.0), _traj(None, 1, 0.0)])
    s1 = Sample(uid="b", task_index=1, trajectories=[_traj("r1", 2, 0.5), _traj(None, 2, 0.5)])  # same id, another group
    batch = build_train_batch([s0, s1], pad_token_id=0)
    assert batch.run_index.tolist() == [0, 0, 1, 2, 3, 4]
    assert batch.run_tokens.tolist() == [5.0, 5.0, 4.0, 1.0, 2.0, 2.0]
    sub = batch.select([1, 4])
    assert sub.run_index.tolist() == [0, 3] and sub.run_tokens.tolist() == [5.0, 2.0]
    adv = compute_grpo_advantages(batch.scores, batch.group_index, batch.loss_mask, run_index=batch.run_index)
    # group 0: runs r1 (1), r2 (0), the unnamed one (0) -> 1.1547005 on both r1 segments
    assert adv[0].max().item() == pytest.approx(1.1547005, abs=1e-5) and adv[1].max().item() == pytest.approx(1.1547005, abs=1e-5)


def test_mini_batches_keep_groups_together():
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    assert split_groups(groups, 2) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert split_groups(groups, 10) == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert split_groups(groups, 1) == [list(range(8))]
    # groups keep their order of first appearance, interleaved rows included
    assert split_groups(torch.tensor([5, 3, 5, 3]), 2) == [[0, 2], [1, 3]]


def test_select_takes_the_rows_and_tokens_of_per_row_meta():
    from ferryman.testing.trainer_contract import random_train_batch

    batch = random_train_batch(50, seed=0)
    b, t = batch.input_ids.shape
    routed = torch.arange(b * t * 2 * 3).view(b, t, 2, 3)
    batch.meta.update(routed_experts=routed, temperature=0.7)
    rows = [b - 1, 0]
    sub = batch.select(rows)
    width = sub.seq_len
    assert width == int(batch.attention_mask[rows].sum(-1).max())
    assert torch.equal(sub.meta["routed_experts"], routed[rows][:, :width])
    assert sub.meta["temperature"] == 0.7 and batch.meta["routed_experts"] is routed
    for idx, mb in batch.micro_batches(max_tokens=2 * t):
        assert mb.meta["routed_experts"].shape[:2] == mb.input_ids.shape
