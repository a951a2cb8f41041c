"""Every config in examples/ validates with the installed plugins, plugin sections included
(core's own test checks the core sections only), and the GPU examples say what they promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferryman.config import ROLE_OF_SECTION, load_config
from ferryman.plugins import PluginHost

ROOT = Path(__file__).resolve().parents[1]
# examples/cluster holds Kubernetes manifests (KubeRay; tests/test_cluster.py checks their command)
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "cluster" not in p.relative_to(ROOT / "examples").parts)


@pytest.fixture(scope="module")
def host():
    return PluginHost()


def _missing_plugins(path: Path, host: PluginHost) -> list[str]:
    import yaml

    data = yaml.safe_load(path.read_text())
    missing = []
    for section, role in ROLE_OF_SECTION.items():
        name = (data.get(section) or {}).get("type")
        if name is not None and name not in host.specs(role):
            missing.append(f"{section}.type={name}")
    return missing


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT / "examples")) for p in EXAMPLES])
def test_example_validates_with_its_plugins(path, host):
    missing = _missing_plugins(path, host)
    if missing:
        # engine-vllm and the cuda_ipc transport may not be installed in this environment yet
        pytest.skip(f"{path.name}: no installed plugin registers {', '.join(missing)}")
    cfg, plugin_cfgs = load_config(path, [], host)
    assert cfg.training.total_steps >= 1
    assert set(plugin_cfgs) >= set(ROLE_OF_SECTION)


def test_gpu_examples_say_what_they_promise():
    one, _ = load_config(ROOT / "examples/gpu/one_gpu.yaml", [], None)
    two, _ = load_config(ROOT / "examples/gpu/two_gpus.yaml", [], None)
    for cfg in (one, two):
        assert cfg.async_training.mode == "d"
        assert cfg.engine["type"] == "vllm" and cfg.trainer["type"] == "fsdp" and cfg.trainer["device"] == "cuda"
        assert cfg.env["type"] == "sequence" and cfg.env["length"] >= 32 and cfg.rollout.max_tokens > cfg.env["length"]
        assert cfg.model.build_tiny and cfg.model.tiny_preset is not None
    # one GPU: every actor shares it, weights over CUDA IPC
    assert one.ray_num_gpus == 1 and one.weight_sync == {"type": "cuda_ipc"}
    assert one.rollout.num_replicas * one.rollout.num_gpus_per_replica + one.ray.trainer.num_gpus <= 1
    assert one.rollout.num_replicas * one.engine["gpu_memory_utilization"] < 1 - one.ray.trainer.num_gpus
    # two GPUs: engines share the first, the trainer has the second, weights over NCCL
    assert two.ray_num_gpus == 2 and two.weight_sync["type"] == "nccl" and two.ray.trainer.num_gpus == 1
    assert two.rollout.num_replicas * two.rollout.num_gpus_per_replica <= 1


def test_one_gpu_with_too_large_shares_fails_naming_the_fields():
    from ferryman.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.num_gpus_per_replica / ray.trainer.num_gpus"):
        load_config(ROOT / "examples/gpu/one_gpu.yaml", ["ray.trainer.num_gpus=0.5"], None)


def test_one_gpu_sglang_is_the_one_gpu_run_with_sglang_engines():
    one, _ = load_config(ROOT / "examples/gpu/one_gpu.yaml", [], None)
    sgl, _ = load_config(ROOT / "examples/gpu/one_gpu_sglang.yaml", [], None)
    assert sgl.engine["type"] == "sglang" and one.engine["type"] == "vllm"
    a, b = one.model_dump(), sgl.model_dump()
    for key in ("engine", "run_dir"):
        a.pop(key), b.pop(key)
    assert a == b  # the same run: model, task, algorithm, modes, trainer, sync
    # each replica's context and running requests as vLLM's; its KV pool holds them all at once
    assert sgl.engine["context_length"] == one.engine["max_model_len"]
    assert sgl.engine["max_running_requests"] == one.engine["max_num_seqs"]
    assert sgl.engine["max_total_tokens"] >= sgl.engine["context_length"] * sgl.engine["max_running_requests"]
