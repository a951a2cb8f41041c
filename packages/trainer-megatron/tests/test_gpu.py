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
