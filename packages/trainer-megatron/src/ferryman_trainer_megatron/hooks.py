"""Registers the ``megatron`` trainer backend. Importing this module imports neither torch nor
Megatron: the config and factory modules are imported when ferryman asks for the records, and
``megatron.core`` only when a backend is built."""

from __future__ import annotations

import ferryman
from ferryman.specs import TrainerSpec


@ferryman.hookimpl
def ferryman_register_trainers() -> list[TrainerSpec]:
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.factory import make_megatron_trainer

    return [
        TrainerSpec(
            "megatron",
            make_megatron_trainer,
            MegatronTrainerConfig,
            "Megatron-core GPTModel actor, optional critic and frozen reference (TP/PP/CP/EP/DP); PPO/GRPO/DAPO losses",
        )
    ]
