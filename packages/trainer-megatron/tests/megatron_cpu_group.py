"""The rank builder of the CPU test of RayMegatronGroup (test_megatron_ray_group.py): runs in
each rank's Ray actor, patches Megatron's CUDA-only calls there (megatron_cpu_patches.py; the
actor's process is the rank's alone) and builds the real MegatronTrainerBackend on the CPU."""

from __future__ import annotations

from typing import Any


def build_rank(config: Any, model_path: str, algorithm: Any, seed: int) -> Any:
    import megatron_cpu_patches
    import torch

    megatron_cpu_patches.apply()
    torch.set_num_threads(1)
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    runtime = MegatronRuntime(config, model_path=model_path, seed=seed, _device="cpu")  # gloo, from the rendezvous
    return MegatronTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed, runtime=runtime)
