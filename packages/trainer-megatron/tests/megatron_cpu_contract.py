"""The generic TrainerContract on the real MegatronRuntime on the CPU (one gloo rank, Megatron's
CUDA-only calls patched in this process: megatron_cpu_patches.py), with a critic and GAE: the
same contract test_gpu.py runs on a GPU. Run by test_megatron_cpu.py in its own pytest process
(the patches must not leak into other tests); not collected by itself (no ``test_`` prefix)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu_patches  # noqa: E402

megatron_cpu_patches.apply()

from ferryman.config import AlgorithmConfig  # noqa: E402
from ferryman.testing.trainer_contract import TrainerContract, fill_train_batch, random_train_batch  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman_trainer_megatron.config import MegatronTrainerConfig  # noqa: E402
from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime  # noqa: E402
from ferryman_trainer_megatron.testing import ACTOR_METRICS, CRITIC_METRICS  # noqa: E402
from ferryman_trainer_megatron.trainer import MegatronTrainerBackend  # noqa: E402

VOCAB = 160


class TestMegatronCPUContract(TrainerContract):
    ACTOR_METRICS = ACTOR_METRICS
    CRITIC_METRICS = CRITIC_METRICS

    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, tmp_path_factory):
        model_dir = str(build_tiny_model(tmp_path_factory.mktemp("c") / "tiny", vocab_size=VOCAB))
        cfg = MegatronTrainerConfig(lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=24, param_dtype="float32",
                                    make_vocab_size_divisible_by=64, use_distributed_optimizer=False)
        backend = MegatronTrainerBackend(cfg, model_path=model_dir, algorithm=AlgorithmConfig(kl_coef=0.05, adv_estimator="gae"),
                                         seed=0, runtime=MegatronRuntime(cfg, model_path=model_dir, seed=0, _device="cpu"))
        yield backend
        backend.close()

    @pytest.fixture
    def make_batch(self, trainer):
        return lambda seed=0: fill_train_batch(trainer, random_train_batch(VOCAB, seed=seed))
