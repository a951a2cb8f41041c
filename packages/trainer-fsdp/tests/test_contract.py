"""The generic trainer contract, run against the FSDP backend with every part switched on
(critic, frozen reference for a KL loss, lr warmup, tiny micro-batches)."""

from __future__ import annotations

import pytest
import torch

from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import TrainerContract, fill_train_batch, random_train_batch
from ferryman.tiny import build_tiny_model
from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

# tiny models: one intra-op thread is much faster than two on a small, busy machine
# (OpenMP workers spin-wait on each other)
torch.set_num_threads(1)

VOCAB = 160


class TestFSDPTrainerContract(TrainerContract):
    ACTOR_METRICS = (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/lr",
    )
    CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm")

    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, tmp_path_factory):
        model_dir = build_tiny_model(tmp_path_factory.mktemp("contract") / "tiny", vocab_size=VOCAB)
        config = FSDPTrainerConfig(
            lr=1e-3,
            critic_lr=1e-3,
            use_critic=True,
            micro_batch_max_tokens=24,
            lr_warmup_steps=2,
        )
        algorithm = AlgorithmConfig(kl_coef=0.05, entropy_coeff=0.01, adv_estimator="gae")
        backend = make_fsdp_trainer(config, model_path=str(model_dir), algorithm=algorithm, seed=0)
        yield backend
        backend.close()

    @pytest.fixture
    def make_batch(self, trainer):
        def make(seed: int = 0):
            return fill_train_batch(trainer, random_train_batch(VOCAB, seed=seed))

        return make
