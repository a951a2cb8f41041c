"""GPU tests (an NVIDIA GPU and megatron-core; never in CI): the TrainerContract on the real
Megatron runtime, and log-probs equal to the fsdp backend's at the same weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from ferryman.config import AlgorithmConfig  # noqa: E402
from ferryman.testing.trainer_contract import TrainerContract, fill_train_batch, random_train_batch  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402

VOCAB = 160


class TestMegatronContract(TrainerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, tmp_path_factory):
        pytest.importorskip("megatron.core")
        if not torch.cuda.is_available():
            pytest.skip("no GPU")
        from ferryman_trainer_megatron.config import MegatronTrainerConfig
        from ferryman_trainer_megatron.factory import make_megatron_trainer

        model_dir = build_tiny_model(tmp_path_factory.mktemp("c") / "tiny", vocab_size=VOCAB)
        backend = make_megatron_trainer(
            MegatronTrainerConfig(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=24, param_dtype="float32"),
            model_path=str(model_dir), algorithm=AlgorithmConfig(kl_coef=0.05, adv_estimator="gae"), seed=0)
        yield backend
        backend.close()

    @pytest.fixture
    def make_batch(self, trainer):
        return lambda seed=0: fill_train_batch(trainer, random_train_batch(VOCAB, seed=seed))


def test_log_probs_and_ppo_step_match_fsdp_at_qwen2_5_1_5b_shape(tmp_path):
    """The issue's parity check on one GPU: random Qwen2.5-1.5B-shaped weights, bf16 on both
    backends, the same batch. bf16 rounds activations to 8 bits of mantissa (~4e-3 relative)
    and the two order their sums differently over 28 layers, so single tokens can differ by a
    few 1e-2; the mean over tokens is what must stay within 1e-2, and one PPO step's loss
    within 2e-2 of its size (the CPU test holds the same comparison to 1e-5 in float32)."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("ferryman_trainer_fsdp")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.factory import make_megatron_trainer
    from transformers import AutoConfig

    path = str(build_tiny_model(tmp_path / "m", preset="qwen2.5-1.5b"))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    alg = AlgorithmConfig(kl_coef=0.0, entropy_coeff=0.0)
    common = dict(lr=1e-6, grad_clip=1.0, micro_batch_max_tokens=4096, param_dtype="bfloat16")
    meg = make_megatron_trainer(MegatronTrainerConfig(**common), model_path=path, algorithm=alg, seed=0)
    fsdp = make_fsdp_trainer(FSDPTrainerConfig(**common, device="cuda", backend="nccl"), model_path=path, algorithm=alg, seed=0)
    try:
        batch = random_train_batch(vocab, seed=0)
        lp_f, lp_m = fsdp.compute_log_probs(batch).double(), meg.compute_log_probs(batch).double()
        mask = batch.attention_mask.clone()
        mask[:, 0] = 0
        diff = (lp_f - lp_m).abs() * mask
        mean = float(diff.sum() / mask.sum())
        print(f"PARITY log-prob mean abs diff {mean:.3e}, max {float(diff.max()):.3e}")
        assert mean < 1e-2, mean
        full = fill_train_batch(fsdp, batch)
        m_f, m_m = fsdp.update_actor(full), meg.update_actor(full)
        print(f"PARITY pg_loss fsdp {m_f['actor/pg_loss']:.6f} megatron {m_m['actor/pg_loss']:.6f}; "
              f"grad_norm {m_f['actor/grad_norm']:.4f} / {m_m['actor/grad_norm']:.4f}")
        scale = max(abs(m_f["actor/pg_loss"]), 1e-3)
        assert abs(m_f["actor/pg_loss"] - m_m["actor/pg_loss"]) < 2e-2 * scale + 1e-4, (m_f, m_m)
        assert abs(m_f["actor/grad_norm"] - m_m["actor/grad_norm"]) < 5e-2 * m_f["actor/grad_norm"], (m_f, m_m)
    finally:
        fsdp.close()
        meg.close()
