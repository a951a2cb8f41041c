"""Vocab-parallel log-probs and entropy on real torch.distributed gloo ranks, against a full
float64 log-softmax of the whole (unpadded) vocabulary.

Tolerance: the shards compute in float32 (max, sum of exp, label logit, sum of exp·z, each
reduced over ranks). For logits of magnitude <= ~4 and V <= 200 terms, the relative error of a
float32 sum of positive terms is <= log2(V)·eps32 ≈ 8 · 6e-8 (pairwise summation), which gives
an absolute error of the log-sum-exp and of the entropy of order 1e-6; 2e-5 leaves a margin of
~10x and is far below any bug (a padded column left in the softmax moves log-probs by > 1e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import multiprocessing as mp  # plain pickling: torch's fd-sharing reductions race with a rank's exit

from ferryman_trainer_megatron.mapping import padded_vocab_size
from ferryman_trainer_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy, vocab_range

ATOL = 2e-5

# forked ranks: a single-threaded parent (an OpenMP pool does not survive fork)
torch.set_num_threads(1)


def _reference(full: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float):
    z = full[..., :vocab].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _data(vocab: int, padded: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 7, padded, generator=g) * 2
    full[..., vocab:] = 25.0  # junk in the padding: must not count
    labels = torch.randint(0, vocab, (2, 7), generator=g)
    w_lp = torch.randn(2, 7, generator=g)
    w_ent = torch.randn(2, 7, generator=g)
    return full, labels, w_lp, w_ent


def _worker(rank: int, world: int, store: str, vocab: int, padded: int, temperature: float, out) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no port to race for
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        full, labels, w_lp, w_ent = _data(vocab, padded)
        start, end = vocab_range(padded, world, rank)
        shard = full[..., start:end].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(
            shard, labels, vocab_start=start, vocab_size=vocab, group=dist.group.WORLD, chunk_tokens=3, temperature=temperature)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        out.put((rank, (lp.detach().tolist(), ent.detach().tolist(), shard.grad.detach().tolist())))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,vocab,divisible,temperature", [
    (2, 151, 16, 1.0),
    # 3 ranks of 64 columns for 100 ids: the last shard is all padding, the middle one partly
    (3, 100, 64, 0.7),
])
def test_matches_full_softmax_values_and_gradients(world, vocab, divisible, temperature, tmp_path):
    padded = padded_vocab_size(vocab, divisible, world)
    # forked ranks (no re-import of torch per rank: seconds, not a minute)
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_worker, args=(r, world, store, vocab, padded, temperature, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, res = queue.get()
        results[rank] = tuple(torch.tensor(x) for x in res)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    full, labels, w_lp, w_ent = _data(vocab, padded)
    ref_lp, ref_ent = _reference(full, labels, vocab, temperature)
    x = full.double().requires_grad_(True)
    r_lp, r_ent = _reference(x, labels, vocab, temperature)
    ((r_lp * w_lp).sum() + (r_ent * w_ent).sum()).backward()
    for rank in range(world):
        lp, ent, grad = results[rank]
        torch.testing.assert_close(lp.double(), ref_lp, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=ATOL, rtol=0)
        start, end = vocab_range(padded, world, rank)
        torch.testing.assert_close(grad.double(), x.grad[..., start:end], atol=ATOL, rtol=0)
    # padded columns get no gradient
    assert all((results[r][2][..., max(0, vocab - vocab_range(padded, world, r)[0]):] == 0).all() for r in range(world))


def test_single_rank_equals_core_lean_log_probs_and_bf16_stays_bf16():
    from ferryman.algorithms import entropy_from_logits, lean_log_probs_from_logits

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 9, 40, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 40, (3, 9), generator=g)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, chunk_tokens=4)
    ref = lean_log_probs_from_logits(logits, labels, chunk_tokens=4)
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits.detach()), atol=1e-5, rtol=0)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0)
