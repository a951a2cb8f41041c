"""``trainer.num_workers: 2`` with the megatron backend: two Ray actors in one placement group,
each a real Megatron rank on the CPU (gloo, tensor parallel 2; Megatron's CUDA-only calls
patched inside the actors only, megatron_cpu_group.py), driven as one backend.

Ray is started with two logical GPUs (the bundles ask for one each, as on a GPU cluster); the
ranks ignore them and run on the CPU."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")
ray = pytest.importorskip("ray")

from ferryman.config import AlgorithmConfig  # noqa: E402
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, hf_reference_log_probs, random_train_batch  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman_trainer_megatron.config import MegatronTrainerConfig  # noqa: E402
from ferryman_trainer_megatron.ray_group import RayMegatronGroup  # noqa: E402

HERE = Path(__file__).parent
VOCAB = 160


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    if ray.is_initialized():
        pytest.skip("needs its own local Ray (two logical GPUs, the tests folder on the workers' path)")
    sys.path.insert(0, str(HERE))  # the group checks here that its rank builder imports
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}})
    yield ray
    ray.shutdown()
    sys.path.remove(str(HERE))


def test_two_megatron_ranks_as_ray_actors_train_export_and_checkpoint(local_ray, tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_model(tmp_path / "tiny", vocab_size=VOCAB))
    cfg = MegatronTrainerConfig(num_workers=2, num_cpus_per_worker=0.5, tensor_parallel_size=2, param_dtype="float32",
                                make_vocab_size_divisible_by=64, lr=1e-3, micro_batch_max_tokens=24,
                                use_distributed_optimizer=False)  # the distributed optimizer refuses CPU parameters
    group = RayMegatronGroup(cfg, model_path=path, algorithm=AlgorithmConfig(kl_coef=0.05), seed=0,
                             _build="megatron_cpu_group:build_rank")
    try:
        assert group.world_size == 2 and group.has_reference and not group.has_critic
        # the ranks are two processes of one torch.distributed group, each half of the model (TP 2)
        assert ray.get([w.process_group.remote() for w in group.workers]) == [(0, 2), (1, 2)]

        batch = random_train_batch(VOCAB, seed=0)
        lp = group.compute_log_probs(batch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref = hf_reference_log_probs(hf, batch)
        assert float((lp.double() - ref).abs().max()) < 1e-4  # float32 rounding (see test_megatron_cpu)

        # weights streamed from rank 0, gathered over TP with the other rank taking part: HF's
        exported = collect_weights(group, 1 << 14)
        hf_sd = hf.state_dict()
        assert set(exported) == set(hf_sd) - {"lm_head.weight"}  # tied embeddings: once
        for name, t in exported.items():
            assert torch.equal(t, hf_sd[name]), name

        full = fill_train_batch(group, batch)
        ckpt = str(tmp_path / "ckpt")
        group.save_checkpoint(ckpt)  # forwarded to both ranks: dist_checkpointing shards
        first = group.update_actor(full)
        assert all(math.isfinite(v) for v in first.values()), first
        moved = collect_weights(group)
        assert any(not torch.equal(moved[n], exported[n]) for n in exported)
        group.load_checkpoint(ckpt)
        restored = collect_weights(group)
        assert all(torch.equal(restored[n], exported[n]) for n in exported)
        again = group.update_actor(full)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert again[key] == pytest.approx(first[key], rel=1e-6, abs=1e-9), key
        assert group.counters["actor_updates"] == 1  # restored to 0, then one more
    finally:
        group.close()
    assert not group.workers
