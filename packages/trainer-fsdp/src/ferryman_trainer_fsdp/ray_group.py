"""Several FSDP ranks as Ray actors in one placement group, driven as one ``TrainerBackend``.

``trainer.num_workers: N`` (N > 1) makes the ``fsdp`` factory return a :class:`RayFSDPGroup`:
core's :class:`~ferryman.cluster.rank_group.RayRankGroup` (one bundle per rank with
``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs, strategy ``placement_strategy``;
one actor per bundle; rendezvous at rank 0's address; every call sent to every rank, rank 0's
answer returned; weight buckets streamed from rank 0) with each rank an ordinary
:class:`~ferryman_trainer_fsdp.trainer.FSDPTrainerBackend` that joins the group.
"""

from __future__ import annotations

from typing import Any

from ferryman.cluster.rank_group import RayRankGroup, settings_from_config


def build_rank(config: Any, model_path: str, algorithm: Any, seed: int) -> Any:
    """One rank's backend (run inside its actor, after the rendezvous variables are set)."""
    from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend

    return FSDPTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed)


class RayFSDPGroup(RayRankGroup):
    """:class:`ferryman.protocols.TrainerBackend` over ``config.num_workers`` FSDP rank actors."""

    def __init__(self, config: Any, *, model_path: str, algorithm: Any, seed: int = 0) -> None:
        self.config = config
        settings = settings_from_config(config, model_path=model_path, algorithm=algorithm, seed=seed)
        if config.device.startswith("cuda") and settings["num_gpus_per_worker"] <= 0:
            settings["num_gpus_per_worker"] = 1.0  # 0 with device cuda means one GPU a rank
        super().__init__(build="ferryman_trainer_fsdp.ray_group:build_rank", **settings)
