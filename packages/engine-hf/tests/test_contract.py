"""HFEngine passes the generic engine contract (ferryman.testing.EngineContract)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from ferryman.testing.engine_contract import EngineContract  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman_engine_hf.engine import HFEngineConfig, make_hf_engine  # noqa: E402


@pytest.fixture(scope="session")
def contract_model_dir(tmp_path_factory):
    # the same directory and arguments as test_engine.py, so the model is built once per session
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-engine-hf", init_std=0.2)


@pytest.fixture(scope="session")
def contract_weights(contract_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(contract_model_dir)
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]


class TestHFEngineContract(EngineContract):
    @pytest.fixture
    async def engine(self, contract_model_dir):
        # a small per-step delay keeps the abort tests deterministic
        engine = make_hf_engine(HFEngineConfig(step_delay_s=0.003), model_path=str(contract_model_dir), replica="contract", seed=0)
        await engine.start()
        yield engine
        await engine.shutdown()

    @pytest.fixture
    def prompt_ids(self, contract_model_dir):
        tok = transformers.AutoTokenizer.from_pretrained(contract_model_dir)
        messages = [{"role": "user", "content": "Repeat the digit 7."}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    @pytest.fixture
    def own_weights(self, contract_weights):
        return contract_weights
