"""Megatron ranks as Ray actors in one placement group, driven as one ``TrainerBackend``.

``trainer.num_workers: N`` (N > 1) makes the ``megatron`` factory return a
:class:`RayMegatronGroup`: core's :class:`~ferryman.cluster.rank_group.RayRankGroup` with one
bundle of ``num_gpus_per_worker`` GPUs per rank, one actor per bundle, a rendezvous at rank 0's
address, and on each rank an ordinary
:class:`~ferryman_trainer_megatron.trainer.MegatronTrainerBackend` that joins the default
process group from the rendezvous variables and builds Megatron's model-parallel groups over
it (tensor × pipeline × context per model replica; the rest data parallel). Every call goes to
every rank; rank 0's answer is returned (the backend reduces its metrics over ranks). Weight
buckets stream from rank 0 while the other ranks take part in every gather; checkpoints are
``dist_checkpointing`` directories that every rank writes its shards into.
"""

from __future__ import annotations

from typing import Any

from ferryman.cluster.rank_group import RayRankGroup, settings_from_config


def build_rank(config: Any, model_path: str, algorithm: Any, seed: int) -> Any:
    """One rank's backend (run inside its actor, after the rendezvous variables are set)."""
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    return MegatronTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed)


class RayMegatronGroup(RayRankGroup):
    """:class:`ferryman.protocols.TrainerBackend` over ``config.num_workers`` Megatron rank actors.

    ``_build`` (``"module:function"``, the keywords of :func:`build_rank`) replaces the rank
    builder; for the CPU test of the group, whose ranks run Megatron with its CUDA-only calls
    patched."""

    def __init__(self, config: Any, *, model_path: str, algorithm: Any, seed: int = 0,
                 _build: str = "ferryman_trainer_megatron.ray_group:build_rank") -> None:
        self.config = config
        super().__init__(build=_build, **settings_from_config(config, model_path=model_path, algorithm=algorithm, seed=seed))
