"""Two FSDP ranks as Ray actors in a placement group (gloo on CPU) match one in-process rank."""

from __future__ import annotations

import os

import pytest
import torch

from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch
from ferryman.tiny import build_tiny_model
from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend, FSDPTrainerConfig, make_fsdp_trainer

ray = pytest.importorskip("ray")
torch.set_num_threads(1)
VOCAB = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", vocab_size=VOCAB))


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _config(**kw):
    # fractional bundles: another test module may have started Ray with a single CPU
    base = dict(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=16, num_threads=1, num_cpus_per_worker=0.1)
    base.update(kw)
    return FSDPTrainerConfig(**base)


def test_two_ray_ranks_match_one_rank(local_ray, model_dir):
    """The SPMD fan-out gives the single-rank update: log-probs, values, metrics, weights (9 rows
    split unevenly, two mini-batches, KL to a reference, a critic), and the checkpoint restores."""
    alg = AlgorithmConfig(kl_coef=0.1)
    # float64 (see test_trainer.SAME_UPDATE_ATOL): two ranks sum gradients in another order
    # than one, and AdamW turns float32 rounding of near-zero gradients into ~1e-5 of weight
    group = make_fsdp_trainer(_config(num_workers=2, param_dtype="float64"), model_path=model_dir, algorithm=alg, seed=0)
    try:
        assert type(group).__name__ == "RayFSDPGroup"
        assert group.has_critic and group.has_reference and group.world_size == 2
        # the ranks really are two processes in one torch.distributed group
        infos = ray.get([w.get_attr.remote("world_size") for w in group.workers])
        assert infos == [2, 2]
        batch2 = fill_train_batch(group, random_train_batch(VOCAB, num_groups=3, group_size=3, seed=3))
        batch2.meta["num_mini_batches"] = 2
        two_actor = group.update_actor(batch2)
        two_critic = group.update_critic(batch2)
        state = group.state_dict_for_checkpoint()
        group.update_actor(batch2)
        two_weights = collect_weights(group, 1 << 14)  # several buckets streamed from rank 0
        group.load_checkpoint_state(state)
        group.update_actor(batch2)
        again = collect_weights(group)
        assert group.counters["actor_updates"] == 2  # restored to 1, then one more
    finally:
        group.close()
    for name, tensor in two_weights.items():
        assert torch.equal(again[name], tensor), f"checkpoint round trip through the group: {name}"

    one = FSDPTrainerBackend(_config(param_dtype="float64"), model_path=model_dir, algorithm=alg, seed=0)
    try:
        batch1 = fill_train_batch(one, random_train_batch(VOCAB, num_groups=3, group_size=3, seed=3))
        batch1.meta["num_mini_batches"] = 2
        # float64 forward passes, stored as float32: equal up to one float32 rounding
        torch.testing.assert_close(batch2.old_log_probs, batch1.old_log_probs, rtol=2**-23, atol=1e-12)
        torch.testing.assert_close(batch2.values, batch1.values, rtol=2**-23, atol=1e-12)
        one_metrics = {**one.update_actor(batch1), **one.update_critic(batch1)}
        one.update_actor(batch1)
        one_weights = collect_weights(one)
    finally:
        one.close()
    two_metrics = {**two_actor, **two_critic}
    for key, value in one_metrics.items():
        assert two_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-10), key
    assert list(two_weights) == list(one_weights)
    for name, tensor in one_weights.items():
        assert tensor.dtype == torch.float64
        torch.testing.assert_close(two_weights[name], tensor, rtol=0, atol=1e-8)  # see SAME_UPDATE_ATOL


@pytest.mark.parametrize("ask", [{"num_cpus_per_worker": 64}, {"worker_resources": {"trainer_node": 1}}], ids=["cpus", "custom-resource"])
def test_group_that_cannot_be_placed_fails_clearly_and_leaves_nothing(local_ray, model_dir, ask):
    before = ray.available_resources().get("CPU", 0)
    with pytest.raises(RuntimeError, match="could not place"):
        make_fsdp_trainer(
            _config(num_workers=2, placement_timeout_s=2, use_critic=False, **ask),
            model_path=model_dir,
            algorithm=AlgorithmConfig(),
        )
    assert ray.available_resources().get("CPU", 0) == before


def test_a_closed_group_says_so(local_ray, model_dir):
    group = make_fsdp_trainer(_config(num_workers=2, use_critic=False), model_path=model_dir, algorithm=AlgorithmConfig())
    group.close()
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        group.compute_log_probs(random_train_batch(VOCAB, num_groups=1, group_size=2, seed=0))
