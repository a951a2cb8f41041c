"""FSDP trainer backend on CPU (gloo, one rank) with tiny Qwen2 models."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch
from ferryman.tiny import build_tiny_model
from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend, FSDPTrainerConfig, make_fsdp_trainer

# tiny models: one intra-op thread is much faster than two on a small, busy machine
# (OpenMP workers spin-wait on each other)
torch.set_num_threads(1)

VOCAB = 160

# Two updates that should be equal, compared after AdamW steps: in float32 the answer would
# depend on the CPU's summation order (AVX2 vs AVX-512 kernels), because Adam divides by
# sqrt(v) + eps and so turns an absolute gradient error d into up to lr * d / eps of weight
# change; float32 rounding leaves d ~ 1e-9 on entries whose gradient is a sum of opposite
# terms, i.e. up to ~1e-4 after a few steps of lr 1e-3. Such tests therefore run the trainer
# in float64 (param_dtype: float64: master weights, optimizer states and all compute): the
# gradient errors there are below 1e-14 (unit roundoff 1.1e-16 times at most ~100 terms of
# magnitude below 1), so 4 AdamW steps of lr 1e-3 move a weight by at most
# 4 * 1e-3 * 1e-14 / 1e-8 = 4e-9 (measured: 7e-15). SAME_UPDATE_ATOL is that bound with
# margin, and still 5 orders of magnitude below one step's size (lr = 1e-3).
FLOAT64 = dict(param_dtype="float64")
SAME_UPDATE_ATOL = 1e-8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model of ferryman.tiny (tied embeddings)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", vocab_size=VOCAB))


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """A tiny Qwen2 with separate lm_head weights."""
    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("models") / "untied"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture
def make_trainer(model_dir):
    """Factory of backends; every backend is closed after the test."""
    made: list[FSDPTrainerBackend] = []

    def make(algorithm: AlgorithmConfig | None = None, path: str | None = None, seed: int = 0, **cfg):
        backend = make_fsdp_trainer(
            FSDPTrainerConfig(**cfg),
            model_path=path or model_dir,
            algorithm=algorithm or AlgorithmConfig(),
            seed=seed,
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def hf_log_probs(model: torch.nn.Module, batch) -> torch.Tensor:
    """Reference: log p(token_t | tokens_<t) from a plain transformers forward, [B, T]."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    out[:, 1:] = lp
    return out * batch.attention_mask


def seq_log_prob(lp: torch.Tensor, batch) -> torch.Tensor:
    return (lp * batch.loss_mask).sum(-1)


# ----------------------------------------------------------------------------- no-grad passes


def test_log_probs_equal_plain_hf_forward(make_trainer, model_dir):
    batch = random_train_batch(VOCAB, num_groups=3, group_size=2, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_log_probs(hf, batch)
    big = make_trainer(micro_batch_max_tokens=1 << 20)
    small = make_trainer(micro_batch_max_tokens=10)
    torch.testing.assert_close(big.compute_log_probs(batch), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(small.compute_log_probs(batch), expected, rtol=0, atol=1e-5)


def test_bfloat16_compute_is_close_to_float32(make_trainer):
    batch = fill_train_batch(make_trainer(), random_train_batch(VOCAB, seed=1))
    bf16 = make_trainer(param_dtype="bfloat16", lr=1e-3)
    lp = bf16.compute_log_probs(batch)
    torch.testing.assert_close(lp, batch.old_log_probs, rtol=0, atol=0.1)
    metrics = bf16.update_actor(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


# ----------------------------------------------------------------------------- actor updates


def test_grpo_update_moves_log_probs_with_the_advantage_sign(make_trainer):
    trainer = make_trainer(lr=1e-3)
    batch = random_train_batch(VOCAB, num_groups=1, group_size=2, seed=5)
    sign = torch.tensor([1.0, -1.0])[:, None]
    batch = replace(batch, old_log_probs=trainer.compute_log_probs(batch), advantages=sign * batch.loss_mask)
    before = seq_log_prob(batch.old_log_probs, batch)
    metrics = trainer.update_actor(batch)
    after = seq_log_prob(trainer.compute_log_probs(batch), batch)
    assert after[0] > before[0] + 1e-3, (before, after)
    assert after[1] < before[1] - 1e-3, (before, after)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/lr"):
        assert key in metrics
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # first step: ratio 1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batching_does_not_change_the_update(make_trainer, agg):
    algorithm = AlgorithmConfig(loss_agg_mode=agg, kl_coef=0.1, entropy_coeff=0.01, clip_ratio_high=0.28)
    common = dict(lr=1e-3, ppo_epochs=2, algorithm=algorithm, **FLOAT64)
    tiny = make_trainer(micro_batch_max_tokens=8, activation_checkpointing=True, **common)
    huge = make_trainer(micro_batch_max_tokens=1 << 20, **common)
    batch = fill_train_batch(huge, random_train_batch(VOCAB, num_groups=4, group_size=2, seed=3))
    batch.meta["num_mini_batches"] = 2
    assert len(list(batch.micro_batches(max_tokens=8))) >= batch.batch_size - 2  # mostly one row each
    before = collect_weights(huge)
    m_tiny = tiny.update_actor(batch)
    m_huge = huge.update_actor(batch)
    assert tiny.counters["actor_steps"] == huge.counters["actor_steps"] == 4  # 2 mini × 2 epochs
    w_tiny, w_huge = collect_weights(tiny), collect_weights(huge)
    assert max(float((w_huge[k] - before[k]).abs().max()) for k in w_huge) > 1e-4  # it moved
    for name in w_huge:
        assert w_huge[name].dtype == torch.float64
        torch.testing.assert_close(w_tiny[name], w_huge[name], rtol=0, atol=SAME_UPDATE_ATOL)
    for key in m_huge:
        # float64 metrics: sums of a few dozen terms of magnitude <= 10 agree to ~1e-14
        assert m_tiny[key] == pytest.approx(m_huge[key], rel=0, abs=1e-10), key


def _layer_forward_calls(trainer) -> list[list[int]]:
    """Install counters of forward calls of each decoder layer's MLP (transformers checkpoints a
    layer's ``forward``, so the layer's own hooks run once, its submodules' again on recompute)."""
    calls: list[list[int]] = []
    for layer in trainer._decoder_layers(trainer.actor):
        counter = [0]
        layer.mlp.register_forward_pre_hook(lambda *_, c=counter: c.__setitem__(0, c[0] + 1))
        calls.append(counter)
    return calls


@pytest.mark.parametrize("count", [0, 1, 2])
def test_selective_checkpointing_recomputes_only_the_first_layers(make_trainer, count):
    """``checkpoint_layers: N`` recomputes the first N decoder layers in backward (their forward
    runs twice per micro-batch) and leaves the others alone, and the update is the same as with
    no checkpointing at all."""
    common = dict(lr=1e-3, micro_batch_max_tokens=1 << 20, **FLOAT64)
    selective = make_trainer(activation_checkpointing=True, checkpoint_layers=count, **common)
    plain = make_trainer(**common)
    batch = fill_train_batch(plain, random_train_batch(VOCAB, num_groups=2, group_size=2, seed=5))
    calls = _layer_forward_calls(selective)
    assert len(calls) == 2
    m_sel = selective.update_actor(batch)
    m_plain = plain.update_actor(batch)
    # one micro-batch: one forward per layer, plus one recompute for the checkpointed ones
    assert [c[0] for c in calls] == [2 if i < count else 1 for i in range(2)]
    w_sel, w_plain = collect_weights(selective), collect_weights(plain)
    for name in w_plain:
        torch.testing.assert_close(w_sel[name], w_plain[name], rtol=0, atol=SAME_UPDATE_ATOL)
    assert m_sel["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], rel=0, abs=1e-12)


def test_checkpoint_layers_beyond_the_model_is_an_error(make_trainer):
    with pytest.raises(ValueError, match="trainer.checkpoint_layers: 3 exceeds the model's 2"):
        make_trainer(activation_checkpointing=True, checkpoint_layers=3)
    with pytest.raises(ValidationError, match="checkpoint_layers"):
        FSDPTrainerConfig(checkpoint_layers=-1)


def test_micro_batching_with_split_runs_does_not_change_the_update(make_trainer):
    """Rows of one agent run (segments) count as one sequence in the seq-mean modes, also when
    micro-batching puts them apart."""
    algorithm = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coeff=0.01)
    common = dict(lr=1e-3, ppo_epochs=1, algorithm=algorithm, **FLOAT64)
    tiny = make_trainer(micro_batch_max_tokens=8, **common)
    huge = make_trainer(micro_batch_max_tokens=1 << 20, **common)
    batch = fill_train_batch(huge, random_train_batch(VOCAB, num_groups=2, group_size=3, seed=4))
    runs = torch.tensor([0, 0, 1, 2, 3, 3])  # in each group, two rows are segments of one run
    row_tokens = batch.loss_mask.sum(-1)
    run_tokens = torch.zeros(4).index_add_(0, runs, row_tokens)[runs]
    batch = replace(batch, run_index=runs, run_tokens=run_tokens)
    m_tiny = tiny.update_actor(batch)
    m_huge = huge.update_actor(batch)
    w_tiny, w_huge = collect_weights(tiny), collect_weights(huge)
    for name in w_huge:
        torch.testing.assert_close(w_tiny[name], w_huge[name], rtol=0, atol=SAME_UPDATE_ATOL)
    assert m_tiny["actor/pg_loss"] == pytest.approx(m_huge["actor/pg_loss"], rel=0, abs=1e-12)
    # and the runs matter: without them the loss is a mean over rows
    plain = make_trainer(micro_batch_max_tokens=1 << 20, **common).update_actor(replace(batch, run_index=None, run_tokens=None))
    assert plain["actor/pg_loss"] != pytest.approx(m_huge["actor/pg_loss"], rel=1e-3)


def test_kl_loss_uses_the_frozen_reference(make_trainer):
    trainer = make_trainer(lr=1e-2, algorithm=AlgorithmConfig(kl_coef=0.5, kl_type="k3"))
    assert trainer.has_reference and not trainer.has_critic
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=7))
    first = trainer.update_actor(batch)
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # actor == reference
    second = trainer.update_actor(batch)
    assert second["actor/kl_loss"] > 0
    # the reference stays at the initial weights
    torch.testing.assert_close(trainer.compute_ref_log_probs(batch), batch.ref_log_probs)


# ----------------------------------------------------------------------------- critic


def test_critic_update_reduces_value_loss(make_trainer):
    trainer = make_trainer(use_critic=True, critic_lr=3e-3, ppo_epochs=2)
    batch = random_train_batch(VOCAB, num_groups=3, group_size=2, seed=11)
    batch.returns = batch.loss_mask * (2 * batch.scores[:, None] - 1)
    losses = []
    for _ in range(8):
        batch.values = trainer.compute_values(batch)
        metrics = trainer.update_critic(batch)
        losses.append(metrics["critic/vf_loss"])
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= metrics.keys()
    assert losses[-1] < 0.5 * losses[0], losses


def test_critic_warmup_skips_actor_updates(make_trainer):
    trainer = make_trainer(use_critic=True, critic_warmup=1, lr=1e-3)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=2))
    before = collect_weights(trainer)
    assert trainer.update_actor(batch) == {"actor/warmup_skip": 1.0}
    assert all(torch.equal(before[k], v) for k, v in collect_weights(trainer).items())
    trainer.update_critic(batch)
    assert "actor/pg_loss" in trainer.update_actor(batch)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("tied", [True, False])
def test_weight_buckets_match_hf_and_reproduce_logits(make_trainer, model_dir, untied_model_dir, tied):
    path = model_dir if tied else untied_model_dir
    trainer = make_trainer(lr=1e-2, path=path)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=6))
    trainer.update_actor(batch)
    trained = trainer.compute_log_probs(batch)
    assert not torch.allclose(trained, batch.old_log_probs, atol=1e-3)

    budget = 16 * 1024  # smaller than the embedding (160 × 64 × 4 bytes)
    buckets = list(trainer.iter_weight_buckets(budget))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= budget or len(bucket) == 1
    assert any(len(b) > 1 for b in buckets)
    assert any(len(b) == 1 and b[0][0] == "model.embed_tokens.weight" for b in buckets)
    weights = dict(kv for b in buckets for kv in b)

    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_sd = fresh.state_dict()
    expected_names = [n for n in hf_sd if not (tied and n == "lm_head.weight")]
    assert [n for b in buckets for n, _ in b] == expected_names
    for name in expected_names:
        assert weights[name].shape == hf_sd[name].shape and weights[name].dtype == torch.float32
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
    if tied:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf_log_probs(fresh, batch), trained, rtol=0, atol=1e-5)

    # asked for by a GPU transport (device != "cpu"): the same buckets, left on the trainer's
    # own device (here the CPU: values equal bit for bit, nothing copied to host memory)
    on_device = list(trainer.iter_weight_buckets(budget, device="cuda"))
    assert [[n for n, _ in b] for b in on_device] == [[n for n, _ in b] for b in buckets]
    for b in on_device:
        for name, t in b:
            assert t.device == trainer.device and t.is_contiguous() and torch.equal(t, weights[name])


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_is_exact(make_trainer):
    cfg = dict(lr=1e-3, critic_lr=1e-3, use_critic=True, lr_warmup_steps=3, micro_batch_max_tokens=20)
    algorithm = AlgorithmConfig(kl_coef=0.1, adv_estimator="gae")
    trainer = make_trainer(algorithm=algorithm, **cfg)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=8))
    batch.meta["num_mini_batches"] = 2
    trainer.update_critic(batch)
    trainer.update_actor(batch)
    state = trainer.state_dict_for_checkpoint()
    assert state["counters"] == {"actor_updates": 1, "actor_steps": 2, "critic_updates": 1, "critic_steps": 2}

    def step(backend):
        metrics = {**backend.update_critic(batch), **backend.update_actor(batch)}
        return metrics, collect_weights(backend), backend.compute_values(batch), torch.rand(3)

    m1, w1, v1, r1 = step(trainer)
    trainer.load_checkpoint_state(state)
    m2, w2, v2, r2 = step(trainer)
    assert m1 == m2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert torch.equal(v1, v2) and torch.equal(r1, r2)
    assert m1["actor/lr"] == pytest.approx(1e-3)  # warmup: steps 3 and 4 of 3

    # resuming in a fresh backend gives the same step too
    resumed = make_trainer(algorithm=algorithm, seed=123, **cfg)
    resumed.load_checkpoint_state(state)
    m3, w3, v3, _ = step(resumed)
    assert m3 == m1
    assert all(torch.equal(w1[k], w3[k]) for k in w1)
    assert torch.equal(v1, v3)


def test_distributed_checkpoint_round_trip_is_exact(make_trainer, tmp_path):
    """save_checkpoint/load_checkpoint (torch.distributed.checkpoint): a fresh backend (other
    seed) that loads the directory makes exactly the update the saved one makes next."""
    cfg = dict(lr=1e-3, critic_lr=1e-3, use_critic=True, lr_warmup_steps=3, micro_batch_max_tokens=20)
    algorithm = AlgorithmConfig(kl_coef=0.1, adv_estimator="gae")
    trainer = make_trainer(algorithm=algorithm, **cfg)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=8))
    batch.meta["num_mini_batches"] = 2
    trainer.update_critic(batch)
    trainer.update_actor(batch)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / ".metadata").is_file() and (tmp_path / "ckpt" / "extra.pt").is_file()

    def step(backend):
        metrics = {**backend.update_critic(batch), **backend.update_actor(batch)}
        return metrics, collect_weights(backend), backend.compute_values(batch), torch.rand(3)

    m1, w1, v1, r1 = step(trainer)
    resumed = make_trainer(algorithm=algorithm, seed=123, **cfg)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.counters == {"actor_updates": 1, "actor_steps": 2, "critic_updates": 1, "critic_steps": 2}
    m2, w2, v2, r2 = step(resumed)
    assert m1 == m2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert torch.equal(v1, v2) and torch.equal(r1, r2)

    # loading back into the backend that moved on rewinds it too
    trainer.load_checkpoint(str(tmp_path / "ckpt"))
    m3, w3, _, _ = step(trainer)
    assert m3 == m1 and all(torch.equal(w1[k], w3[k]) for k in w1)


def test_distributed_checkpoint_before_any_update(make_trainer, tmp_path):
    """A checkpoint of an optimizer that never stepped holds no optimizer state, and saving it
    does not create one: the next update equals a fresh backend's first update."""
    trainer = make_trainer(lr=1e-3)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=4))
    trainer.save_checkpoint(str(tmp_path / "c0"))
    assert not trainer.actor_optim.state
    fresh = make_trainer(lr=1e-3)
    expected = fresh.update_actor(batch)
    trainer.update_actor(batch)  # moves on, then is rewound to the never-stepped state
    trainer.load_checkpoint(str(tmp_path / "c0"))
    assert not trainer.actor_optim.state
    assert trainer.update_actor(batch) == expected
    w_t, w_f = collect_weights(trainer), collect_weights(fresh)
    assert all(torch.equal(w_t[k], w_f[k]) for k in w_f)


def test_distributed_checkpoint_refuses_another_layout(make_trainer, tmp_path):
    make_trainer(use_critic=True).save_checkpoint(str(tmp_path / "with_critic"))
    with pytest.raises(ValueError, match="use_critic"):
        make_trainer().load_checkpoint(str(tmp_path / "with_critic"))
    with pytest.raises(ValueError, match="not a checkpoint"):
        make_trainer().load_checkpoint(str(tmp_path))


def test_lr_warmup(make_trainer):
    trainer = make_trainer(lr=1e-3, lr_warmup_steps=4)
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, seed=9))
    batch.meta["num_mini_batches"] = 3
    assert trainer.update_actor(batch)["actor/lr"] == pytest.approx(1e-3 * (1 + 2 + 3) / 4 / 3)
    assert trainer.actor_optim.param_groups[0]["lr"] == pytest.approx(1e-3)


# ----------------------------------------------------------------------------- lifecycle, config


def test_close_destroys_the_process_group_it_created(model_dir):
    was_initialized = dist.is_initialized()
    a = make_fsdp_trainer(FSDPTrainerConfig(), model_path=model_dir, algorithm=AlgorithmConfig(), seed=0)
    b = make_fsdp_trainer(FSDPTrainerConfig(), model_path=model_dir, algorithm=AlgorithmConfig(), seed=0)
    assert dist.is_initialized() and dist.get_world_size() == 1
    a.close()
    assert dist.is_initialized()  # b still uses it
    b.close()
    b.close()  # idempotent
    assert dist.is_initialized() == was_initialized


def test_config_validation():
    assert FSDPTrainerConfig().type == "fsdp"
    for bad in ({"lr": -1.0}, {"ppo_epochs": 0}, {"micro_batch_max_tokens": 0}, {"critic_warmup": -1},
                {"param_dtype": "float16"}, {"betas": (0.9, 1.5)}, {"unknown": 1}, {"type": "megatron"}):
        with pytest.raises(ValidationError):
            FSDPTrainerConfig(**bad)


def test_gae_without_critic_is_refused(model_dir):
    with pytest.raises(ValueError, match="use_critic"):
        make_fsdp_trainer(FSDPTrainerConfig(), model_path=model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"))


def test_hooks_import_without_torch_and_register_the_backend():
    code = "import sys, ferryman_trainer_fsdp.hooks\nassert 'torch' not in sys.modules, 'hooks imported torch'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    from ferryman.plugins import PluginHost
    from ferryman_trainer_fsdp import hooks

    spec = PluginHost(load_entry_points=False, extra_plugins=(hooks,)).get("trainer", "fsdp")
    assert spec.factory is make_fsdp_trainer and spec.config_cls is FSDPTrainerConfig


# ----------------------------------------------------------------------------- two ranks

_TWO_RANK_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch
from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

model_dir, out = sys.argv[1], sys.argv[2]
config = FSDPTrainerConfig(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=16)
trainer = make_fsdp_trainer(config, model_path=model_dir, algorithm=AlgorithmConfig(kl_coef=0.1), seed=0)
assert trainer.world_size == 2
batch = fill_train_batch(trainer, random_train_batch(160, num_groups=3, group_size=3, seed=3))
batch.meta["num_mini_batches"] = 2
result = {"old": batch.old_log_probs, "values": batch.values}
result["actor"] = trainer.update_actor(batch)
result["critic"] = trainer.update_critic(batch)
state = trainer.state_dict_for_checkpoint()
trainer.update_actor(batch)
result["weights"] = collect_weights(trainer, 1 << 14)
trainer.load_checkpoint_state(state)
trainer.update_actor(batch)
again = collect_weights(trainer)
assert all(torch.equal(again[k], v) for k, v in result["weights"].items()), "round trip"
# a sharded distributed checkpoint, written by both ranks, loaded by one in the test
trainer.save_checkpoint(out + ".dcp")
result["dcp_weights"] = collect_weights(trainer)
result["dcp_values"] = trainer.compute_values(batch)
if trainer.rank == 0:
    torch.save(result, out)
trainer.close()
"""


@pytest.mark.slow
def test_two_ranks_match_one_rank(request, make_trainer, model_dir, tmp_path):
    """Data parallel over two gloo ranks (torchrun) gives the single-rank results. Rows are split
    unevenly (9 rows), so ranks run different numbers of real micro-batches."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("starts two processes (~1 min on 2 cores); select with -m slow")
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANK_SCRIPT)
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), model_dir, str(out)]  # noqa: E501
    subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    two = torch.load(out)

    trainer = make_trainer(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=16,
                           algorithm=AlgorithmConfig(kl_coef=0.1))
    batch = fill_train_batch(trainer, random_train_batch(VOCAB, num_groups=3, group_size=3, seed=3))
    batch.meta["num_mini_batches"] = 2
    torch.testing.assert_close(two["old"], batch.old_log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(two["values"], batch.values, rtol=0, atol=1e-5)
    one_actor, one_critic = trainer.update_actor(batch), trainer.update_critic(batch)
    trainer.update_actor(batch)
    for key, value in {**one_actor, **one_critic}.items():
        assert {**two["actor"], **two["critic"]}[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    weights = collect_weights(trainer)
    assert list(two["weights"]) == list(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-4, atol=1e-5)

    # the checkpoint sharded over two ranks loads on one rank (DCP reshards) exactly
    one = make_trainer(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=16,
                       algorithm=AlgorithmConfig(kl_coef=0.1), seed=5)
    one.load_checkpoint(str(out) + ".dcp")
    loaded = collect_weights(one)
    assert all(torch.equal(loaded[k], v) for k, v in two["dcp_weights"].items())
    torch.testing.assert_close(one.compute_values(batch), two["dcp_values"], rtol=0, atol=1e-5)
    assert one.counters["actor_updates"] == 2 and one.counters["critic_updates"] == 1  # 1, rewound to 1, +1
