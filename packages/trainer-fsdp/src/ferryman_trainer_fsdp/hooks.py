"""Registers the ``fsdp`` trainer backend. Importing this module does not import torch: the
backend module is imported only when ferryman asks for the registration records."""

from __future__ import annotations

import ferryman
from ferryman.specs import TrainerSpec


@ferryman.hookimpl
def ferryman_register_trainers() -> list[TrainerSpec]:
    from ferryman_trainer_fsdp.export import export_hf
    from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

    return [
        TrainerSpec(
            "fsdp",
            make_fsdp_trainer,
            FSDPTrainerConfig,
            "FSDP2 (fully_shard) actor, optional critic and frozen reference; PPO/GRPO/DAPO losses",
            exporter=export_hf,
        )
    ]
