"""The factory registered as trainer ``megatron`` (imports Megatron only when it builds)."""

from __future__ import annotations

from typing import Any

from ferryman.config import AlgorithmConfig
from ferryman_trainer_megatron.config import MEGATRON_EXTRA, MEGATRON_REQUIREMENT, MegatronTrainerConfig


class MegatronMissingError(ImportError):
    """megatron-core is not installed."""


def require_megatron() -> None:
    """Raise :class:`MegatronMissingError` (one line naming the extra) without megatron-core.

    Points Transformer Engine at torch's cuDNN first (:func:`~ferryman_trainer_megatron.cuda_libs.share_torch_cudnn`):
    importing Megatron imports TE, which picks its cuDNN then."""
    from ferryman_trainer_megatron.cuda_libs import share_torch_cudnn

    share_torch_cudnn()
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MegatronMissingError(
            f"trainer.type=megatron needs {MEGATRON_REQUIREMENT}: install the extra "
            f"'{MEGATRON_EXTRA}' (uv sync --extra megatron) on a machine with CUDA GPUs ({e})"
        ) from None


def make_megatron_trainer(
    config: MegatronTrainerConfig,
    *,
    model_path: str,
    algorithm: AlgorithmConfig | None = None,
    seed: int = 0,
    **_: Any,
):
    """Build a :class:`~ferryman_trainer_megatron.trainer.MegatronTrainerBackend` on Megatron-core
    (see :mod:`ferryman.specs` for the keywords)."""
    algorithm = algorithm if algorithm is not None else AlgorithmConfig()
    if algorithm.adv_estimator == "gae" and not config.use_critic:
        raise ValueError("trainer.use_critic must be true with algorithm.adv_estimator='gae' (GAE needs values)")
    require_megatron()
    if config.num_workers > 1:
        from ferryman_trainer_megatron.ray_group import RayMegatronGroup

        return RayMegatronGroup(config, model_path=model_path, algorithm=algorithm, seed=seed)
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    return MegatronTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed)
