"""Context parallelism on real torch.distributed gloo ranks (forked processes): the load-balanced
split, the gathers and their gradients, the all-gather attention against causal attention over
the whole sequence in one process, and the trainer's per-token log-probs with the sequence split
against the same without it.

Tolerances: the split, the gathers and the reordering move values without arithmetic, so they
are compared exactly. The attention computes in float64 on both sides: the only difference is
the order of the softmax sums (two key blocks against one), of order L · eps64 ≈ 1e-14, so 1e-10
is wide and still far below any layout error (a query that sees one key too many or too few
moves its output by O(0.1)). The log-probs compute in float32 from the same logits on both
sides, chunk by chunk in another grouping of positions: each position's arithmetic is the same,
so they agree to a few float32 ulps of a log-sum-exp of magnitude < 10 (~1e-6); 1e-5 is used."""

from __future__ import annotations

import multiprocessing as mp  # plain pickling: torch's fd-sharing reductions race with a rank's exit

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ferryman_trainer_megatron.context_parallel import ContextSplit, context_parallel_attention, padded_length, zigzag_positions

torch.set_num_threads(1)  # forked ranks: a single-threaded parent


def test_zigzag_positions_cover_the_sequence_once_and_balance_causal_work():
    for size in (1, 2, 3, 4):
        length = 2 * size * 5
        held = [zigzag_positions(length, size, r) for r in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(length))
        # causal work of a position p is p + 1 keys: every rank gets the same total
        work = {int((h + 1).sum()) for h in held}
        assert len(work) == 1, (size, work)
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="2 × 2 equal chunks"):
        zigzag_positions(6, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        zigzag_positions(8, 2, 2)


def test_padded_length():
    assert padded_length(13, 1) == 13
    assert padded_length(13, 1, multiple=2) == 14
    assert padded_length(13, 2) == 16
    assert padded_length(16, 2) == 16
    assert padded_length(13, 2, multiple=2) == 16
    assert padded_length(17, 3, multiple=2) == 24
    assert padded_length(1, 2) == 4


def test_split_of_size_one_is_the_identity_and_a_wrong_length_is_refused():
    x = torch.arange(12.0).view(2, 6)
    s = ContextSplit(1, 0, None, 6)
    assert s.split(x) is x and s.gather(x) is x
    assert torch.equal(ContextSplit(2, 1, None, 8).split(torch.arange(8.0)[None]), torch.tensor([[2.0, 3, 4, 5]]))
    with pytest.raises(ValueError, match="7 positions, the split is of 8"):
        ContextSplit(2, 0, None, 8).split(torch.zeros(1, 7))


def _case(heads: int, groups: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(length, b, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(length, b, groups, d, generator=g, dtype=torch.float64)
    v = torch.randn(length, b, groups, d, generator=g, dtype=torch.float64)
    w = torch.randn(b, heads, length, d, generator=g, dtype=torch.float64)  # weights of a scalar loss
    lp = torch.randn(b, length, generator=g, dtype=torch.float64)
    return q, k, v, w, lp


def _reporting(fn):
    """A rank's body that sends its failure to the test instead of leaving it waiting."""
    def run(rank: int, world: int, store: str, *args) -> None:
        out = args[-1]
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            out.put((rank, fn(rank, world, *args[:-1])))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.put((rank, f"rank {rank}: {type(e).__name__}: {e}"))
            raise
        finally:
            dist.destroy_process_group()

    return run


def _collect(target, world: int, store: str, *args) -> dict[int, list]:
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, store, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    failed = [r for r in results.values() if isinstance(r, str)]
    assert not failed, failed
    assert all(p.exitcode == 0 for p in procs)
    return results


@_reporting
def _attention_rank(rank: int, world: int, heads: int, groups: int, length: int) -> list:
    q, k, v, w, lp = _case(heads, groups, length)
    split = ContextSplit(world, rank, dist.group.WORLD, length)
    # attention: local queries, keys and values in local order
    ql, kl, vl = (split.split(t, 0).clone().requires_grad_(True) for t in (q, k, v))
    o = context_parallel_attention(ql, kl, vl, split, enable_gqa=groups != heads)
    (o * split.split(w, 2)).sum().backward()
    # a replicated consumer of a gathered per-token tensor: the same loss on every rank
    lpl = split.split(lp, 1).clone().requires_grad_(True)
    full = split.gather(lpl)
    (full.pow(2) * torch.arange(length, dtype=full.dtype)).sum().backward()
    return [t.detach().tolist() for t in (o, ql.grad, kl.grad, vl.grad, full, lpl.grad)]


@pytest.mark.parametrize("world,heads,groups,length", [
    (2, 4, 2, 12),  # grouped-query attention
    (3, 2, 2, 18),  # three ranks: middle chunks
])
def test_attention_and_gathers_equal_the_whole_sequence_in_one_process(world, heads, groups, length, tmp_path):
    results = {r: [torch.tensor(x, dtype=torch.float64) for x in res]
               for r, res in _collect(_attention_rank, world, str(tmp_path / "store"), heads, groups, length).items()}
    q, k, v, w, lp = (t.requires_grad_(True) for t in _case(heads, groups, length))
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=groups != heads)
    (ref * w).sum().backward()
    (lp.pow(2) * torch.arange(length, dtype=lp.dtype)).sum().backward()
    for rank in range(world):
        s = ContextSplit(world, rank, None, length)
        o, gq, gk, gv, full, glp = results[rank]
        torch.testing.assert_close(o, s.split(ref.detach(), 2), atol=1e-10, rtol=0)
        torch.testing.assert_close(gq, s.split(q.grad, 0), atol=1e-10, rtol=0)
        torch.testing.assert_close(gk, s.split(k.grad, 0), atol=1e-10, rtol=0)  # every rank's queries' share summed
        torch.testing.assert_close(gv, s.split(v.grad, 0), atol=1e-10, rtol=0)
        assert torch.equal(full, lp.detach())
        assert torch.equal(glp, s.split(lp.grad, 1))


@_reporting
def _log_prob_rank(rank: int, world: int) -> list:
    from ferryman.testing.trainer_contract import random_train_batch
    from ferryman_trainer_megatron.trainer import LogitsShard, token_log_probs

    vocab, padded = 50, 64
    sub = random_train_batch(vocab, seed=3)  # rows of different lengths: right padding
    sub.meta["temperature"] = 0.8
    b, t = sub.input_ids.shape
    g = torch.Generator().manual_seed(3)
    length = padded_length(t + 1, world)  # at least one padded position beyond the rows
    logits = torch.randn(b, length, padded, generator=g)  # the model's output at every padded position
    split = ContextSplit(world, rank, dist.group.WORLD, length)
    local = split.split(logits, 1).clone().requires_grad_(True)
    lp, ent = token_log_probs(LogitsShard(local, 0, vocab, None, split), sub, chunk_tokens=3)
    (lp.sum() + 0.5 * ent.sum()).backward()
    whole = logits[:, :t].clone().requires_grad_(True)
    lp1, ent1 = token_log_probs(LogitsShard(whole, 0, vocab, None), sub, chunk_tokens=3)
    (lp1.sum() + 0.5 * ent1.sum()).backward()
    grad_ref = F.pad(whole.grad, (0, 0, 0, length - t))
    return [x.detach().tolist() for x in (lp, ent, lp1, ent1, local.grad, split.split(grad_ref, 1))]


def test_token_log_probs_with_the_sequence_split_equal_the_whole_rows(tmp_path):
    world = 2
    results = _collect(_log_prob_rank, world, str(tmp_path / "store"))
    for rank in range(world):
        lp, ent, lp1, ent1, grad, grad_ref = (torch.tensor(x) for x in results[rank])
        torch.testing.assert_close(lp, lp1, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ent1, atol=1e-5, rtol=0)
        assert lp.abs().sum() > 0 and (lp[:, 0] == 0).all()
        torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=0)
