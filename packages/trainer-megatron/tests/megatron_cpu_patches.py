"""Megatron-core on the CPU, for tests only: Megatron has no CPU path, so ``apply()`` patches
its CUDA-only calls *in the calling process* (a test runs it in its own subprocess):

- ``torch.cuda.current_device`` -> "cpu" (the rotary embedding moves its frequencies there);
- small tensors the optimizer and the schedule allocate with ``device="cuda"`` (loss scale,
  grad norm, the token counter) go to the CPU, inside those calls only (a global
  ``torch.tensor`` wrapper was seen to change the model's forward);
- grad clipping (it asserts ``torch.cuda.FloatTensor`` and scales with a CUDA kernel) is the
  same arithmetic on CPU tensors;
- ``torch.cuda.current_stream`` / ``synchronize`` / ``empty_cache`` are no-ops (the grad sync
  waits on CUDA-graph events that do not exist here), streams and events are stand-ins whose
  waits do nothing (the MoE all-to-all dispatcher's side stream), ``Tensor.cuda()`` returns the tensor
  (a tied embedding's last-stage copy under pipeline parallelism);
- the MoE all-to-all dispatcher's host copy of its split sizes gives numpy arrays on the CPU
  too (as it does from CUDA);
- the model-parallel RNG tracker's ``fork`` is a no-op (dropout is 0);
- context parallelism's slice of the rotary embedding (``get_pos_emb_on_this_cp_rank``) builds
  its chunk index in pinned memory for a CUDA copy: the same slice with a CPU index.

The distributed optimizer is not covered: it refuses CPU parameters outright. Also here, for the
scripts on several ranks: ``shared_tempdir``."""

import contextlib
import tempfile

import torch

_APPLIED = False


def shared_tempdir(prefix: str) -> str:
    """A temporary folder made by rank 0; every rank of the default group gets its path."""
    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _cpu(fn):
    def wrapped(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


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


def _clip_on_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Scale every grad by max_norm / (norm + 1e-6) when that is below 1 (Megatron's rule)."""
    coeff = max_norm / (float(total_norm) + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            g = getattr(p, "decoupled_grad" if use_decoupled_grad else "grad", None)
            if g is not None:
                g.detach().mul_(coeff)


class _NoEvent:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream:
    """Stands in for a CUDA stream: CPU work is already ordered, so every wait is a no-op."""

    def __init__(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def record_event(self, *a, **k) -> _NoEvent:
        return _NoEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _to_host(tensor, as_numpy=False, record_stream=False):
    """Megatron's helper moves only CUDA tensors (and turns them into numpy arrays, which the
    all-to-all takes as split sizes); a CPU tensor came back as a tensor, which it refuses."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's ``get_pos_emb_on_this_cp_rank`` with its index on the CPU: chunks ``r`` and
    ``2·cp − 1 − r`` of ``2·cp`` along ``seq_dim``."""
    cp, r = cp_group.size(), cp_group.rank()
    idx = torch.tensor([r, 2 * cp - r - 1])
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"
    current = _NoStream()
    torch.cuda.current_stream = lambda *a, **k: current
    # the MoE all-to-all dispatcher copies its splits to the host on a side stream
    torch.cuda.Stream = _NoStream  # classes: annotations such as `torch.cuda.Stream | None` work
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = _NoEvent
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # a tied embedding's last-stage copy is moved with .cuda() before its first all-reduce
    torch.Tensor.cuda = lambda self, *a, **k: self
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.optimizer as mopt_impl
    import megatron.core.pipeline_parallel.schedules as sched
    from megatron.core import tensor_parallel

    mopt.get_megatron_optimizer = _inside_cpu_tensors(mopt.get_megatron_optimizer)
    for cls in (mopt_impl.FP32Optimizer, mopt_impl.ChainedOptimizer, mopt_impl.Float16OptimizerWithFloat16Params):
        cls.step = _inside_cpu_tensors(cls.step)
    mopt_impl.clip_grad_by_total_norm_fp32 = _clip_on_cpu
    # zeros only: the forward runs inside the schedule
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"):
        setattr(sched, name, _inside_cpu_tensors(getattr(sched, name), ("zeros",)))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary

    rotary.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    dispatcher.maybe_move_tensor_to_cpu = _to_host
