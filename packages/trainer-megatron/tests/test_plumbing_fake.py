"""The backend's RL plumbing with Megatron behind FakeMegatronRuntime (a transformers model on
CPU that hands over padded-vocabulary logits as Megatron's last stage would): the generic
TrainerContract, log-probs equal to a plain full softmax of the HF model, and the one-line error
without megatron-core."""

from __future__ import annotations

import pytest
import torch

from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import TrainerContract, fill_train_batch, hf_reference_log_probs, random_train_batch
from ferryman.tiny import build_tiny_model
from ferryman_trainer_megatron.config import MegatronTrainerConfig
from ferryman_trainer_megatron.testing import ACTOR_METRICS, CRITIC_METRICS, FakeMegatronRuntime
from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

torch.set_num_threads(1)
VOCAB = 160


def make(model_dir, algorithm, **cfg):
    config = MegatronTrainerConfig(**cfg)
    return MegatronTrainerBackend(config, model_path=str(model_dir), algorithm=algorithm, seed=0,
                                  runtime=FakeMegatronRuntime(config, model_path=str(model_dir), seed=0))


class TestFakeMegatronContract(TrainerContract):
    ACTOR_METRICS = ACTOR_METRICS
    CRITIC_METRICS = CRITIC_METRICS

    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, tmp_path_factory):
        model_dir = build_tiny_model(tmp_path_factory.mktemp("contract") / "tiny", vocab_size=VOCAB)
        backend = make(model_dir, AlgorithmConfig(kl_coef=0.05, entropy_coeff=0.01, adv_estimator="gae"),
                       lr=1e-3, critic_lr=1e-3, use_critic=True, micro_batch_max_tokens=24, lr_warmup_steps=2,
                       make_vocab_size_divisible_by=64)
        yield backend
        backend.close()

    @pytest.fixture
    def make_batch(self, trainer):
        def make_(seed: int = 0):
            return fill_train_batch(trainer, random_train_batch(VOCAB, seed=seed))

        return make_


def test_log_probs_equal_the_hf_model_despite_vocab_padding(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "tiny", vocab_size=VOCAB)
    backend = make(model_dir, AlgorithmConfig(), micro_batch_max_tokens=20, make_vocab_size_divisible_by=128)
    try:
        assert backend.rt.padded_vocab == 256  # the fake's logits carry 96 junk columns
        batch = random_train_batch(VOCAB, seed=3)
        batch.meta["temperature"] = 0.8
        lp = backend.compute_log_probs(batch)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = hf_reference_log_probs(hf, batch, temperature=0.8)
        torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
    finally:
        backend.close()


def test_factory_without_megatron_fails_with_one_line_naming_the_extra(tmp_path):
    pytest.importorskip("ferryman_trainer_megatron.factory")
    try:
        import megatron.core  # noqa: F401

        pytest.skip("megatron-core is installed here")
    except ImportError:
        pass
    from ferryman_trainer_megatron.factory import MegatronMissingError, make_megatron_trainer

    with pytest.raises(MegatronMissingError) as info:
        make_megatron_trainer(MegatronTrainerConfig(), model_path=str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "ferryman-trainer-megatron[megatron]" in msg


def test_a_built_batch_with_routed_experts_goes_through(tmp_path):
    """build_train_batch's meta['routed_experts'] ([B, T, layers, top-k]) survives the backend's
    micro-batching (the fake runs a dense model: nothing is replayed)."""
    from ferryman.batch import build_train_batch
    from ferryman.types import Sample, TokenOutput, Trajectory

    model_dir = build_tiny_model(tmp_path / "tiny", vocab_size=VOCAB)
    backend = make(model_dir, AlgorithmConfig(), micro_batch_max_tokens=12)
    try:
        trajs = []
        for r, (prompt, answer) in enumerate([([3, 4, 5], [6, 7, 8, 9]), ([10, 11], [12, 13])]):
            t = Trajectory(request_id=f"t{r}", prompt_ids=prompt)
            seq = prompt + answer
            t.append_model_tokens(TokenOutput(answer, [-1.0] * len(answer), [0] * len(answer),
                                              routed_experts=[[[i % 4, (i + 1) % 4]] * 2 for i in range(len(seq) - 1)]))
            trajs.append(t)
        batch = build_train_batch([Sample("u", 0, trajs)], pad_token_id=0)
        assert batch.meta["routed_experts"].shape == (*batch.input_ids.shape, 2, 2)
        lp = backend.compute_log_probs(batch)
        assert lp.shape == batch.input_ids.shape and torch.isfinite(lp).all()
    finally:
        backend.close()
