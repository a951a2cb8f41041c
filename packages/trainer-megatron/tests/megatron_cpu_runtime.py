"""The real MegatronRuntime + MegatronTrainerBackend on CPU gloo ranks (torchrun), with
Megatron's CUDA-only calls patched in this process only (see megatron_cpu_check.py). Runs the
TrainerContract-like steps that matter: log-probs equal HF's, an update changes the weights and
returns finite metrics, exported weights equal an HF state dict layout, a dist_checkpointing
save/load round trip restores the weights. Prints ``RESULT ok`` on success."""

import contextlib
import math
import os
import sys
import tempfile

import torch

torch.cuda.current_device = lambda: "cpu"
torch.set_num_threads(1)


def _cpu(fn):
    def wrapped(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


# Megatron's optimizer allocates a few small tensors with device="cuda" (loss scale, grad norm):
# redirect them to the CPU, but only inside the optimizer (a global torch.tensor wrapper was seen
# to change the model's forward)
import megatron.core.optimizer as _mopt  # noqa: E402
import megatron.core.optimizer.optimizer as _mopt_impl  # noqa: E402


@contextlib.contextmanager
def _cpu_tensors(names=("tensor", "zeros", "empty", "ones", "full")):
    saved = {n: getattr(torch, n) for n in names}
    for n, fn in saved.items():
        setattr(torch, n, _cpu(fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)


def _inside_cpu_tensors(fn, names=("tensor", "zeros", "empty", "ones", "full")):
    def wrapped(*a, **k):
        with _cpu_tensors(names):
            return fn(*a, **k)

    return wrapped


_mopt.get_megatron_optimizer = _inside_cpu_tensors(_mopt.get_megatron_optimizer)
for _cls in (_mopt_impl.FP32Optimizer, _mopt_impl.ChainedOptimizer, _mopt_impl.Float16OptimizerWithFloat16Params):
    _cls.step = _inside_cpu_tensors(_cls.step)
import megatron.core.pipeline_parallel.schedules as _sched  # noqa: E402

# the schedule's token counter (torch.zeros on "cuda"); zeros only: the forward runs inside
_sched.forward_backward_no_pipelining = _inside_cpu_tensors(_sched.forward_backward_no_pipelining, ("zeros",))
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.empty_cache = lambda *a, **k: None
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from megatron.core import tensor_parallel  # noqa: E402

tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

from ferryman.config import AlgorithmConfig  # noqa: E402
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman_trainer_megatron.config import MegatronTrainerConfig  # noqa: E402
from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime  # noqa: E402
from ferryman_trainer_megatron.trainer import MegatronTrainerBackend  # noqa: E402

tp = int(os.environ.get("CHECK_TP", "1"))
holder = [tempfile.mkdtemp(prefix="ferryman-mrt-") if rank == 0 else None]
dist.broadcast_object_list(holder, src=0)
root = holder[0]
if rank == 0:
    build_tiny_model(os.path.join(root, "tiny"), vocab_size=160)
dist.barrier()
path = os.path.join(root, "tiny")
cfg = MegatronTrainerConfig(param_dtype="float32", tensor_parallel_size=tp, make_vocab_size_divisible_by=64, lr=1e-3,
                            micro_batch_max_tokens=24, use_distributed_optimizer=world // tp > 1)
alg = AlgorithmConfig(kl_coef=0.05)
backend = MegatronTrainerBackend(cfg, model_path=path, algorithm=alg, seed=0,
                                 runtime=MegatronRuntime(cfg, model_path=path, seed=0, _device="cpu"))
batch = random_train_batch(160, seed=0)
lp = backend.compute_log_probs(batch)
from transformers import AutoModelForCausalLM  # noqa: E402

hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
with torch.no_grad():
    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
ref = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
ref = torch.nn.functional.pad(ref, (1, 0)) * batch.attention_mask
d = (lp.double() - ref).abs()
if d.max() > 1e-4:
    print("DIFF", d.max(dim=1).values.tolist(), batch.attention_mask.sum(-1).tolist(), flush=True)
assert d.max().item() < 1e-4, d.max().item()
w0 = collect_weights(backend)
hf_sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
assert set(w0) == set(hf_sd), sorted(set(w0) ^ set(hf_sd))
for k in hf_sd:
    assert torch.equal(w0[k], hf_sd[k]), k
full = fill_train_batch(backend, batch)
ckpt = os.path.join(root, "ckpt")
backend.save_checkpoint(ckpt)
m = backend.update_actor(full)
assert all(math.isfinite(v) for v in m.values()) and "actor/pg_loss" in m and "actor/grad_norm" in m, m
w1 = collect_weights(backend)
assert any(not torch.equal(w0[k], w1[k]) for k in w0), "update changed nothing"
backend.update_actor(full)  # an optimizer that stepped: its states go into the next checkpoint
ckpt2 = os.path.join(root, "ckpt2")
backend.save_checkpoint(ckpt2)
w2 = collect_weights(backend)
m3 = backend.update_actor(full)
w3 = collect_weights(backend)
backend.load_checkpoint(ckpt2)
assert all(torch.equal(collect_weights(backend)[k], w2[k]) for k in w2), "load did not restore"
m3b = backend.update_actor(full)
w3b = collect_weights(backend)
for k in w3:
    torch.testing.assert_close(w3b[k], w3[k], atol=1e-6, rtol=1e-5)
backend.load_checkpoint(ckpt)
assert all(torch.equal(collect_weights(backend)[k], w0[k]) for k in w0)
backend.close()
if rank == 0:
    print("RESULT ok", m["actor/pg_loss"], m["actor/grad_norm"], flush=True)
dist.destroy_process_group()
sys.exit(0)
