"""A reusable pytest contract for :class:`ferryman.protocols.TrainerBackend` implementations.

Subclass :class:`TrainerContract` in a test module and provide two fixtures::

    from ferryman.testing.trainer_contract import TrainerContract, fill_train_batch, random_train_batch

    class TestMyTrainer(TrainerContract):
        @pytest.fixture(scope="class")
        @classmethod
        def trainer(cls, tmp_path_factory):
            backend = make_my_trainer(...)
            yield backend
            backend.close()

        @pytest.fixture
        def make_batch(self, trainer):
            def make(seed: int = 0):
                return fill_train_batch(trainer, random_train_batch(vocab_size=160, seed=seed))
            return make

``make_batch`` returns a function ``(seed: int = 0) -> TrainBatch`` whose batch has
``old_log_probs`` and non-zero ``advantages``; a batch for another seed should differ. The
contract fills ``ref_log_probs`` (when ``trainer.has_reference``) and ``values``/``returns``
(when ``trainer.has_critic``) itself if they are missing. The trainer's learning rate must be
large enough that one update visibly changes the weights (any ``lr > 0`` works in float32).

The contract checks protocol conformance, the shapes and alignment of the no-grad passes, that
row order and micro-batching do not change results, that updates return finite metrics and change
the weights, the weight-bucket rules, and that a checkpoint round trip reproduces an update.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from ferryman.algorithms import compute_grpo_advantages
from ferryman.batch import TrainBatch, build_train_batch
from ferryman.protocols import TrainerBackend
from ferryman.types import Sample, Trajectory

__all__ = ["TrainerContract", "fill_train_batch", "random_train_batch", "collect_weights"]


def random_train_batch(
    vocab_size: int,
    *,
    num_groups: int = 3,
    group_size: int = 2,
    max_prompt: int = 6,
    max_response: int = 8,
    seed: int = 0,
    pad_token_id: int = 0,
    min_token_id: int = 3,
) -> TrainBatch:
    """A TrainBatch of random trajectories built with :func:`ferryman.batch.build_train_batch`.

    Rows have different lengths (so there is padding), some responses contain an observation
    span (mask 0) between model spans, rewards are random, and rows with the same group share a
    prompt. Token ids are drawn from ``[min_token_id, vocab_size)``.
    """
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(min_token_id, vocab_size) for _ in range(n)]

    samples = []
    for g in range(num_groups):
        prompt = tokens(rng.randint(2, max_prompt))
        trajs = []
        for j in range(group_size):
            t = Trajectory(request_id=f"g{g}-r{j}", prompt_ids=list(prompt))
            n1 = rng.randint(1, max(1, max_response // 2))
            t.response_ids += tokens(n1)
            t.response_mask += [1] * n1
            t.rollout_log_probs += [-1.0] * n1
            t.token_versions += [0] * n1
            if rng.random() < 0.5:
                t.append_observation(tokens(rng.randint(1, 2)))
                n2 = rng.randint(1, max(1, max_response // 2))
                t.response_ids += tokens(n2)
                t.response_mask += [1] * n2
                t.rollout_log_probs += [-1.0] * n2
                t.token_versions += [0] * n2
            t.reward = float(rng.random())
            trajs.append(t)
        samples.append(Sample(uid=f"s{g}", task_index=g, trajectories=trajs))
    return build_train_batch(samples, pad_token_id=pad_token_id)


def fill_train_batch(trainer: TrainerBackend, batch: TrainBatch) -> TrainBatch:
    """Fill what an update needs: old log-probs (recomputed), GRPO advantages, and reference
    log-probs / values / returns when the trainer has a reference / critic. Returns a copy."""
    changes: dict[str, Any] = {}
    if batch.old_log_probs is None:
        changes["old_log_probs"] = trainer.compute_log_probs(batch)
    if batch.advantages is None:
        changes["advantages"] = compute_grpo_advantages(batch.scores, batch.group_index, batch.loss_mask)
    if trainer.has_reference and batch.ref_log_probs is None:
        changes["ref_log_probs"] = trainer.compute_ref_log_probs(batch)
    if trainer.has_critic and batch.values is None:
        values = trainer.compute_values(batch)
        changes["values"] = values
        if batch.returns is None:
            changes["returns"] = (values + batch.scores[:, None].float()) * batch.loss_mask
    elif trainer.has_critic and batch.returns is None:
        changes["returns"] = (batch.values + batch.scores[:, None].float()) * batch.loss_mask
    return replace(batch, **changes)


def reference_log_probs(logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """What a backend's ``compute_log_probs(batch)`` must give, from a reference model's
    ``logits`` of ``batch.input_ids`` ([B, T, V]): log p(token_t | tokens_<t) at temperature
    ``temperature`` in float64, [B, T], 0 at position 0 (no prediction) and on padding."""
    lp = torch.log_softmax(logits[:, :-1].double() / temperature, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)) * batch.attention_mask


def hf_reference_log_probs(model: Any, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """:func:`reference_log_probs` from a transformers causal LM's forward of ``batch``."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    return reference_log_probs(logits, batch, temperature)


def collect_weights(trainer: TrainerBackend, bucket_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    """All actor weights from ``iter_weight_buckets``, by name."""
    out: dict[str, torch.Tensor] = {}
    for bucket in trainer.iter_weight_buckets(bucket_bytes):
        for name, tensor in bucket:
            out[name] = tensor
    return out


def _assert_finite_metrics(metrics: dict[str, float], required: tuple[str, ...]) -> None:
    assert isinstance(metrics, dict)
    for key in required:
        assert key in metrics, f"metric {key!r} missing from {sorted(metrics)}"
    for key, value in metrics.items():
        assert isinstance(value, float | int), f"metric {key!r} is {type(value).__name__}, not a number"
        assert math.isfinite(value), f"metric {key!r} is not finite: {value}"


class TrainerContract:
    """Tests every TrainerBackend must pass. Subclasses provide ``trainer`` and ``make_batch``."""

    ACTOR_METRICS: tuple[str, ...] = ("actor/pg_loss", "actor/grad_norm")
    """Metrics ``update_actor`` must return (subclasses may extend)."""
    CRITIC_METRICS: tuple[str, ...] = ("critic/vf_loss", "critic/grad_norm")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def full_batch(trainer: TrainerBackend, make_batch: Callable[..., TrainBatch], seed: int = 0) -> TrainBatch:
        return fill_train_batch(trainer, make_batch(seed=seed))

    # ------------------------------------------------------------------ protocol
    def test_protocol_conformance(self, trainer: TrainerBackend) -> None:
        assert isinstance(trainer, TrainerBackend)
        assert isinstance(trainer.has_critic, bool)
        assert isinstance(trainer.has_reference, bool)

    def test_make_batch_fixture(self, make_batch: Callable[..., TrainBatch]) -> None:
        batch = make_batch(seed=0)
        assert isinstance(batch, TrainBatch)
        assert batch.old_log_probs is not None and batch.advantages is not None
        assert batch.old_log_probs.shape == batch.input_ids.shape
        assert batch.advantages.shape == batch.input_ids.shape
        assert float((batch.advantages * batch.loss_mask).abs().sum()) > 0, "advantages are all zero"

    # ------------------------------------------------------------------ no-grad passes
    def _check_per_token(self, out: torch.Tensor, batch: TrainBatch, what: str) -> None:
        assert isinstance(out, torch.Tensor), f"{what} is {type(out).__name__}"
        assert out.shape == (batch.batch_size, batch.seq_len), f"{what} shape {tuple(out.shape)}"
        assert out.dtype == torch.float32, f"{what} dtype {out.dtype}"
        assert out.device.type == "cpu", f"{what} on {out.device}"
        assert not out.requires_grad
        assert torch.isfinite(out).all(), f"{what} has non-finite entries"
        assert (out[:, 0] == 0).all(), f"{what}: position 0 must be 0"
        pad = batch.attention_mask == 0
        assert (out[pad] == 0).all(), f"{what}: padding positions must be 0"

    def test_log_prob_shapes(self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]) -> None:
        batch = make_batch(seed=0)
        lp = trainer.compute_log_probs(batch)
        self._check_per_token(lp, batch, "compute_log_probs")
        real = batch.attention_mask.bool()
        real[:, 0] = False
        assert (lp[real] <= 0).all(), "log-probs must be <= 0"
        assert (lp[real] < 0).any()

    def test_log_probs_deterministic_and_row_order_invariant(
        self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]
    ) -> None:
        batch = make_batch(seed=1)
        lp = trainer.compute_log_probs(batch)
        torch.testing.assert_close(trainer.compute_log_probs(batch), lp)
        order = list(reversed(range(batch.batch_size)))
        permuted = batch.select(order)
        lp_perm = trainer.compute_log_probs(permuted)
        width = permuted.seq_len
        torch.testing.assert_close(lp_perm, lp[order][:, :width], rtol=1e-4, atol=1e-4)

    def test_ref_log_probs(self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]) -> None:
        if not trainer.has_reference:
            pytest.skip("trainer has no reference model")
        batch = make_batch(seed=0)
        self._check_per_token(trainer.compute_ref_log_probs(batch), batch, "compute_ref_log_probs")

    def test_values(self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]) -> None:
        if not trainer.has_critic:
            pytest.skip("trainer has no critic")
        batch = make_batch(seed=0)
        self._check_per_token(trainer.compute_values(batch), batch, "compute_values")

    # ------------------------------------------------------------------ updates
    def test_update_actor_returns_finite_metrics_and_changes_weights(
        self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]
    ) -> None:
        batch = self.full_batch(trainer, make_batch, seed=2)
        before = collect_weights(trainer)
        metrics = trainer.update_actor(batch)
        if metrics.get("actor/warmup_skip"):
            pytest.skip("the trainer is in critic warmup")
        _assert_finite_metrics(metrics, self.ACTOR_METRICS)
        after = collect_weights(trainer)
        assert before.keys() == after.keys()
        assert any(not torch.equal(before[k], after[k]) for k in before), "update_actor changed nothing"

    def test_update_critic_returns_finite_metrics(
        self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]
    ) -> None:
        if not trainer.has_critic:
            pytest.skip("trainer has no critic")
        batch = self.full_batch(trainer, make_batch, seed=3)
        before = trainer.compute_values(batch)
        metrics = trainer.update_critic(batch)
        _assert_finite_metrics(metrics, self.CRITIC_METRICS)
        assert not torch.equal(before, trainer.compute_values(batch)), "update_critic changed nothing"

    # ------------------------------------------------------------------ weights
    def test_weight_buckets(self, trainer: TrainerBackend) -> None:
        everything = list(trainer.iter_weight_buckets(1 << 40))
        assert len(everything) == 1, "with a huge budget everything fits one bucket"
        sizes = {name: t.numel() * t.element_size() for name, t in everything[0]}
        assert sizes, "no weights"
        # a budget that splits the weights and is smaller than the largest tensor
        budget = max(1, sorted(sizes.values())[len(sizes) // 2])
        names: list[str] = []
        for bucket in trainer.iter_weight_buckets(budget):
            assert isinstance(bucket, list) and bucket, "a bucket must be a non-empty list"
            total = 0
            for name, t in bucket:
                assert isinstance(name, str)
                assert isinstance(t, torch.Tensor)
                assert t.device.type == "cpu"
                assert t.is_contiguous()
                assert not t.requires_grad
                total += t.numel() * t.element_size()
                names.append(name)
            assert total <= budget or len(bucket) == 1, f"bucket of {total} bytes > {budget}"
        assert len(names) == len(set(names)), "duplicate names"
        assert names == [n for n, _ in everything[0]], "names/order differ between bucket sizes"

    def test_weight_buckets_on_the_device(self, trainer: TrainerBackend) -> None:
        """A backend whose ``iter_weight_buckets`` takes ``device`` (what a GPU weight sync asks
        for) gives the same names and values there, on its own device, contiguous, detached."""
        from ferryman.sync import takes_keyword

        if not takes_keyword(trainer.iter_weight_buckets, "device"):
            pytest.skip("iter_weight_buckets takes no device (optional): always CPU tensors")
        on_cpu = [kv for b in trainer.iter_weight_buckets(1 << 40) for kv in b]
        on_dev = [kv for b in trainer.iter_weight_buckets(1 << 40, device="cuda") for kv in b]
        assert [n for n, _ in on_dev] == [n for n, _ in on_cpu], "names/order differ from the CPU buckets"
        for (name, c), (_, d) in zip(on_cpu, on_dev, strict=True):
            assert d.is_contiguous() and not d.requires_grad, name
            assert d.shape == c.shape, name
            assert torch.equal(d.to("cpu", c.dtype), c), f"{name}: on-device values differ from the CPU ones"

    # ------------------------------------------------------------------ checkpoints
    def test_checkpoint_round_trip(self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch]) -> None:
        batch = self.full_batch(trainer, make_batch, seed=4)
        state = trainer.state_dict_for_checkpoint()
        assert isinstance(state, dict)

        def step() -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor | None]:
            metrics = {}
            values = None
            if trainer.has_critic:
                metrics.update(trainer.update_critic(batch))
                values = trainer.compute_values(batch)
            metrics.update(trainer.update_actor(batch))
            return metrics, collect_weights(trainer), values

        m1, w1, v1 = step()
        trainer.load_checkpoint_state(state)
        m2, w2, v2 = step()
        assert w1.keys() == w2.keys()
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], msg=lambda m, n=name: f"{n}: {m}")
        if v1 is not None:
            torch.testing.assert_close(v2, v1)
        assert m1.keys() == m2.keys()
        for key in m1:
            assert math.isclose(m1[key], m2[key], rel_tol=1e-4, abs_tol=1e-6), (key, m1[key], m2[key])

    def test_checkpoint_directory_round_trip(
        self, trainer: TrainerBackend, make_batch: Callable[..., TrainBatch], tmp_path: Any
    ) -> None:
        """What a run checkpoint does (:func:`ferryman.checkpoint.save_trainer_state`: the
        backend's own ``save_checkpoint`` if it has one, else ``torch.save``) round-trips."""
        from ferryman.checkpoint import load_trainer_state, save_trainer_state

        batch = self.full_batch(trainer, make_batch, seed=5)
        save_trainer_state(trainer, tmp_path / "trainer")
        before = collect_weights(trainer)
        trainer.update_actor(batch)
        load_trainer_state(trainer, tmp_path / "trainer")
        after = collect_weights(trainer)
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} not restored"
