"""The Megatron-core runtime of the ``megatron`` backend (CUDA only; megatron-core 0.19.x).

Built from the 0.19.2 sources: ``parallel_state.initialize_model_parallel``, ``GPTModel`` with
``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``, Megatron's
``DistributedDataParallel`` and ``get_megatron_optimizer`` (distributed optimizer),
``get_forward_backward_func`` (pipeline schedules; ``variable_seq_lengths`` so that every
micro-batch keeps its own length), ``finalize_model_grads``, ``RouterReplay`` and
``dist_checkpointing``. See the README for what is tested where.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ferryman.batch import TrainBatch
from ferryman.cluster.connect import free_port
from ferryman_trainer_megatron.config import MegatronTrainerConfig
from ferryman_trainer_megatron.context_parallel import ContextSplit, padded_length
from ferryman_trainer_megatron.convert import hf_shapes, hf_to_megatron, layout, megatron_to_hf, to_global_name, tp_merge, tp_split
from ferryman_trainer_megatron.mapping import (
    gpt_model_kwargs,
    model_shape,
    optimizer_config_kwargs,
    padded_vocab_size,
    transformer_config_kwargs,
)
from ferryman_trainer_megatron.trainer import Head, LogitsShard
from ferryman_trainer_megatron.vocab_parallel import vocab_range

_USERS = 0


def build_transformer_config(kwargs: dict[str, Any]):
    """``TransformerConfig`` from :func:`~ferryman_trainer_megatron.mapping.transformer_config_kwargs`
    (resolves the activation and dtype names)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(kwargs)
    kw["activation_func"] = {"silu": F.silu}[kw["activation_func"]]
    for key in ("params_dtype", "pipeline_dtype"):
        kw[key] = getattr(torch, kw[key])
    return TransformerConfig(**kw)


def with_sdpa_attention(spec: Any) -> Any:
    """``spec`` (a local GPT layer spec) with :class:`~ferryman_trainer_megatron.sdpa_attention.SDPACoreAttention`
    as its self-attention's ``core_attention`` (a copy; the spec passed in is not changed)."""
    from dataclasses import replace

    from ferryman_trainer_megatron.sdpa_attention import SDPACoreAttention

    attn = spec.submodules.self_attention
    attn = replace(attn, submodules=replace(attn.submodules, core_attention=SDPACoreAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attn))


def tolerate_torch_adam_step(optim: Any) -> None:
    """Work around a megatron-core 0.19.2 bug in loading distributed-optimizer checkpoints
    without Apex or Transformer Engine (found on the H200, bench/results/gpu_megatron.md).

    There the inner optimizer is torch's AdamW, whose per-parameter state holds a ``step``
    tensor. ``DistributedOptimizer.load_state_dict`` restores ``step`` itself (from the param
    groups), then ``load_parameter_state_from_fully_reshardable`` hands each parameter's
    tensors to ``_set_main_param_and_optimizer_states`` *without* ``step`` ("handled
    separately"), which copies every tensor of the live state and so fails with
    ``KeyError: 'step'``. This wraps that method on each distributed optimizer of ``optim``
    (chained ones included) to pass the live ``step`` through, already restored, when the
    loaded tensors lack it; any other missing state still fails as before. A no-op where the
    method or the condition is absent (Apex/TE optimizers keep ``step`` in the param groups).
    It also wraps ``load_state_dict`` to untie the restored ``step`` tensors (:func:`untie_adam_steps`)."""
    for o in getattr(optim, "chained_optimizers", None) or [optim]:
        original = getattr(o, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(o, "_ferryman_step_tolerant", False):
            continue

        def tolerant(model_param: Any, tensors: dict[str, Any], _o: Any = o, _original: Any = original) -> Any:
            if "step" not in tensors and not _o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                group, order = _o.model_param_group_index_map[model_param]
                live = _o.optimizer.state[_o.optimizer.param_groups[group]["params"][order]].get("step")
                if isinstance(live, torch.Tensor):
                    tensors = {**tensors, "step": live}
            return _original(model_param, tensors)

        o._set_main_param_and_optimizer_states = tolerant
        original_load = getattr(o, "load_state_dict", None)
        if original_load is not None:
            def load_untied(state_dict: Any, _o: Any = o, _original: Any = original_load) -> Any:
                result = _original(state_dict)
                untie_adam_steps(_o.optimizer)
                return result

            o.load_state_dict = load_untied
        o._ferryman_step_tolerant = True


def untie_adam_steps(optimizer: Any) -> None:
    """Give every parameter's ``step`` its own tensor again (the second half of the 0.19.2 bug
    above, found on the H200 as a failed checkpoint round trip). Without Apex/TE,
    ``DistributedOptimizer.load_state_dict`` assigns one ``step`` tensor to every parameter's
    state (``s["step"] = step`` in a loop, megatron/core/optimizer/distrib_optimizer.py), and torch's
    ``load_state_dict`` keeps that one object for a non-fused, non-capturable AdamW. AdamW then
    adds 1 to it in place once per parameter on each step, so after a restore the bias correction
    runs as if hundreds of steps had passed and the update differs from the uninterrupted one."""
    state = getattr(optimizer, "state", None)
    if not state:
        return
    for s in state.values():
        step = s.get("step") if isinstance(s, dict) else None
        if isinstance(step, torch.Tensor):
            s["step"] = step.clone()


class _Handle:
    def __init__(self, role: str, model: Any, module: Any, optim: Any, config: Any) -> None:
        self.role, self.model, self.module, self.optim, self.config = role, model, module, optim, config
        self.owners: dict[str, int] | None = None


class _ValueHead(torch.nn.Module):
    """The critic's output layer: hidden -> one value per token. Its parameters are named
    ``weight`` and ``bias`` (not a nested ``Linear``): Megatron's ``sharded_state_dict`` of a
    ``GPTModel`` expects ``output_layer.weight`` on the last stage."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        # [s, b, h] -> [b, s]
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias)[..., 0].transpose(0, 1).float()


class MegatronRuntime:
    """One rank of a Megatron model replica group (see :class:`ferryman_trainer_megatron.trainer.Runtime`)."""

    def __init__(self, config: MegatronTrainerConfig, *, model_path: str, seed: int = 0, _device: str = "cuda") -> None:
        """``_device="cpu"`` is for the CPU check of this class (tests/megatron_cpu_runtime.py,
        which patches Megatron's CUDA-only calls); runs use CUDA."""
        global _USERS
        from ferryman_trainer_megatron.cuda_libs import share_torch_cudnn

        if _device == "cuda":
            share_torch_cudnn()  # before Megatron imports Transformer Engine (a Ray worker starts here)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from transformers import AutoConfig

        cuda = _device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("trainer.type=megatron needs CUDA GPUs (Megatron-core has no CPU path)")
        self.config = config
        self.model_path = model_path
        self._own_group = False
        if not dist.is_initialized():
            backend = "nccl" if cuda else "gloo"
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend, timeout=timedelta(minutes=30))
            else:
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                        timeout=timedelta(minutes=30))
            self._own_group = True
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        world = dist.get_world_size()
        if world % config.model_parallel_size:
            raise ValueError(f"world size {world} is not a multiple of tensor × pipeline × context = {config.model_parallel_size}")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=config.tensor_parallel_size,
                pipeline_model_parallel_size=config.pipeline_parallel_size,
                context_parallel_size=config.context_parallel_size,
                expert_model_parallel_size=config.expert_parallel_size,
                expert_tensor_parallel_size=config.expert_tensor_parallel_size,
            )
        _USERS += 1
        self.ps = ps
        if cuda:
            model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.shape = model_shape(self.hf_config)
        self.tc_kwargs = transformer_config_kwargs(self.shape, config)
        self.padded_vocab = padded_vocab_size(self.shape.vocab_size, config.make_vocab_size_divisible_by, config.tensor_parallel_size)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.cp = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        # the ranks of one context-parallel group compute the same gathered outputs: one reports
        self.reporter = self.last and self.tp_rank == 0 and self.cp_rank == 0
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.shape.is_moe else 0
        self.etp = ps.get_expert_tensor_parallel_world_size() if self.shape.is_moe else 1
        self.etp_rank = ps.get_expert_tensor_parallel_rank() if self.shape.is_moe else 0
        self.etp_group = ps.get_expert_tensor_parallel_group() if self.shape.is_moe else None
        self.te = config.transformer_impl == "transformer_engine"
        self.sdpa = not self.te and config.local_attention == "sdpa"
        self._hf_files: dict[str, str] | None = None

    # ------------------------------------------------------------------ building
    def _spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

        s = self.shape
        if self.te:
            return get_gpt_layer_with_transformer_engine_spec(num_experts=s.num_experts, moe_grouped_gemm=s.is_moe, qk_layernorm=s.qk_norm)
        spec = get_gpt_layer_local_spec(num_experts=s.num_experts, moe_grouped_gemm=False, qk_layernorm=s.qk_norm, normalization="RMSNorm")
        if self.sdpa:
            spec = with_sdpa_attention(spec)
        return spec

    def _hf_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if self._hf_files is None:
            import json

            index = os.path.join(self.model_path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self._hf_files = {k: os.path.join(self.model_path, v) for k, v in weight_map.items()}
            else:
                single = os.path.join(self.model_path, "model.safetensors")
                with safe_open(single, "pt") as f:
                    self._hf_files = {k: single for k in f.keys()}
        if name not in self._hf_files:
            raise KeyError(f"{self.model_path}: the checkpoint has no tensor {name}")
        with safe_open(self._hf_files[name], "pt") as f:
            return f.get_tensor(name)

    def _offsets(self, module: Any) -> tuple[int, int]:
        layers = module.decoder.layers
        layer_offset = int(layers[0].layer_number) - 1 if len(layers) else 0
        expert_offset = self.ep_rank * ((self.shape.num_experts or 0) // self.config.expert_parallel_size)
        return layer_offset, expert_offset

    @torch.no_grad()
    def _load_hf(self, module: Any, critic: bool) -> None:
        entries = {e.mg: e for e in layout(self.shape, transformer_engine=self.te, critic=critic)}
        lo, eo = self._offsets(module)
        loaded = 0
        for local, param in module.named_parameters():
            if local.startswith("output_layer.") and critic:
                continue  # the value head
            name = to_global_name(local, lo, eo)
            if name == "output_layer.weight" and self.shape.tied_embeddings:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding
            entry = entries.get(name)
            if entry is None:
                raise KeyError(f"no HF source for Megatron parameter {local} (global {name})")
            full = hf_to_megatron(entry, [self._hf_tensor(n) for n in entry.hf], self.shape, self.padded_vocab)
            tp, rank = (self.etp, self.etp_rank) if entry.expert is not None else (self.tp, self.tp_rank)
            shard = tp_split(entry, full, tp, rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{local}: converted shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
            param.copy_(shard.to(param.device, param.dtype))
            loaded += 1
        if loaded == 0:
            raise RuntimeError("no parameters loaded")

    def build(self, role: str) -> _Handle:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        critic = role == "critic"
        if critic and self.config.sequence_parallel:
            raise ValueError("trainer.use_critic with trainer.sequence_parallel is not supported yet")
        tconf = build_transformer_config(self.tc_kwargs)
        with torch.device(self.device):
            module = GPTModel(tconf, self._spec(), pre_process=self.first, post_process=self.last,
                              **gpt_model_kwargs(self.shape, self.config, critic=critic))
        if critic and self.last:
            module.output_layer = _ValueHead(self.shape.hidden_size, tconf.params_dtype).to(self.device)
        module.to(self.device)
        self._load_hf(module, critic)
        if tconf.params_dtype != torch.float32:
            # the local spec's norms (torch.nn.RMSNorm) are built in float32 whatever params_dtype
            # says; Megatron-LM's Float16Module casts the whole model, and so does this (the
            # optimizer keeps float32 main weights of every parameter either way). The offloading
            # optimizer needs it: it cannot take the float32 parameters' shard views.
            for param in module.parameters():
                if param.dtype == torch.float32:
                    param.data = param.data.to(tconf.params_dtype)
        if role == "ref":
            module.requires_grad_(False)
            module.eval()
            return _Handle(role, module, module, None, tconf)
        ddp = DistributedDataParallel(
            tconf,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=self.config.use_distributed_optimizer),
            module=module,
        )
        optim = get_megatron_optimizer(
            OptimizerConfig(**optimizer_config_kwargs(self.config, critic=critic, params_dtype=tconf.params_dtype)), [ddp])
        tolerate_torch_adam_step(optim)
        ddp.eval()
        return _Handle(role, ddp, module, optim, tconf)

    # ------------------------------------------------------------------ forward / backward
    def _replay(self, handle: _Handle, sub: TrainBatch, split: ContextSplit) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        routed = sub.meta.get("routed_experts")
        if routed is None:
            raise ValueError("trainer.router_replay: the batch has no meta['routed_experts'] ([B, T, moe layers, top-k])")
        routed = torch.as_tensor(routed)
        lo, _ = self._offsets(handle.module)
        n_local = len(handle.module.decoder.layers)
        per_layer = []
        top_k = routed.shape[-1]
        for i in range(n_local):
            # the tokens this rank's routers see: the padded row, this rank's context-parallel
            # positions, then (sequence parallel) its tensor-parallel slice of those. Positions
            # past the row take experts 0..k-1 (k distinct experts per token, as the dispatcher
            # counts them; the padding mask keeps them out of the loss)
            layer = torch.arange(top_k, dtype=routed.dtype).expand(routed.shape[0], split.length, top_k).clone()
            layer[:, : sub.seq_len] = routed[:, : sub.seq_len, lo + i]
            layer = split.split(layer, 1)
            if self.config.sequence_parallel:
                layer = layer.chunk(self.tp, dim=1)[self.tp_rank]
            # Megatron's tokens are [s, b] flattened: token index = s * B + b
            per_layer.append(layer.transpose(0, 1).reshape(-1, top_k).to(self.device))
        RouterReplay.set_replay_data(per_layer)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def run(self, handle: _Handle, micro_batches: list[TrainBatch], head: Head, forward_only: bool) -> list[dict[str, Any]]:
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        records: list[dict[str, Any]] = []
        start, _ = vocab_range(self.padded_vocab, self.tp, self.tp_rank)
        critic = handle.role == "critic"
        multiple = self.tp if self.config.sequence_parallel else 1
        tp_group = self.tp_group if self.tp > 1 else None

        def loss_func(sub: TrainBatch, split: ContextSplit, output: torch.Tensor):
            given: Any
            if critic:  # values of this rank's positions -> whole rows, the same on the group
                given = split.gather(output)[:, : sub.seq_len]
            elif split.size > 1:  # the head gathers its per-token outputs
                given = LogitsShard(output, start, self.shape.vocab_size, tp_group, split)
            else:
                given = LogitsShard(output[:, : sub.seq_len], start, self.shape.vocab_size, tp_group)
            loss, rec = head(given, sub)
            records.append({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in rec.items()})
            return loss, torch.ones((), dtype=torch.int, device=self.device), {}

        def forward_step(data_iterator, model):
            sub = next(data_iterator)
            # right-padded so that context parallelism cuts 2 × cp chunks and sequence
            # parallelism splits each rank's share over the TP ranks
            split = ContextSplit(self.cp, self.cp_rank, self.cp_group, padded_length(sub.seq_len, self.cp, multiple))
            ids, pos = sub.input_ids, sub.position_ids
            pad = split.length - ids.shape[1]
            if pad:
                ids = torch.nn.functional.pad(ids, (0, pad))
                pos = torch.nn.functional.pad(pos, (0, pad))
            ids, pos = split.split(ids.to(self.device)), split.split(pos.to(self.device))
            t = ids.shape[1]
            # right padding + causal mask: real tokens never see padding (TE and SDPA are causal
            # by themselves; Megatron's DotProductAttention reads a [1, 1, t, t] mask)
            mask = None if self.te or self.sdpa else torch.ones(1, 1, t, t, dtype=torch.bool, device=self.device).triu(1)
            kwargs: dict[str, Any] = {}
            if self.shape.is_moe:
                pm = sub.attention_mask == 0
                kwargs["padding_mask"] = split.split(torch.nn.functional.pad(pm, (0, pad), value=True).to(self.device))
                if self.config.router_replay:
                    self._replay(handle, sub, split)
            if critic and self.last:
                kwargs["output_processor"] = lambda hidden_states, output_layer, **_: output_layer(hidden_states)
            out = model(ids, pos, mask, **kwargs)
            return out, lambda output: loss_func(sub, split, output)

        fb = get_forward_backward_func()
        if not forward_only:
            handle.model.train()
            handle.model.zero_grad_buffer()
            handle.optim.zero_grad()
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        seq = max((mb.seq_len for mb in micro_batches), default=1)
        with ctx:
            fb(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[handle.model],
               num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=1, forward_only=forward_only)
        if not forward_only:
            finalize_model_grads([handle.model], num_tokens=None)
            handle.model.eval()
        if self.config.router_replay:
            from megatron.core.transformer.moe.router_replay import RouterReplay

            RouterReplay.clear_global_indices()
            RouterReplay.clear_global_router_replay_action()
        return records if self.reporter else []

    def step(self, handle: _Handle, lr: float) -> float:
        for group in handle.optim.param_groups:
            group["lr"] = lr
        ok, norm, _ = handle.optim.step()
        handle.optim.zero_grad()
        return float(norm) if ok and norm is not None else float("nan")

    # ------------------------------------------------------------------ collectives
    def _reduce(self, t: torch.Tensor, op: Any, group: Any = None) -> torch.Tensor:
        moved = t.to(self.device)
        dist.all_reduce(moved, op=op, group=group)
        return moved.to(t.device)

    def world_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM, self.dp_group)

    def dp_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX, self.dp_group)

    # ------------------------------------------------------------------ weights
    def iter_hf_weights(self, handle: _Handle, *, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors: float32 CPU copies, or with ``on_device`` views of the gathered
        buffer on this rank's device in the parameters' dtype (a fresh buffer per entry)."""
        module = handle.module
        lo, eo = self._offsets(module)
        params = {to_global_name(n, lo, eo): p for n, p in module.named_parameters()}
        entries = layout(self.shape, transformer_engine=self.te, critic=handle.role == "critic")
        if handle.owners is None:
            held = [e.mg for e in entries if e.mg in params]
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (dist.get_rank(), self.tp_rank if True else 0, self.etp_rank, held))
            owners: dict[str, int] = {}
            for rank, tp_rank, etp_rank, names in sorted(everyone):
                for n in names:
                    owners.setdefault(n, rank)
            handle.owners = owners
        dtype = handle.config.params_dtype
        for e in entries:
            shapes = hf_shapes(e, self.shape)
            numel = sum(int(torch.Size(s).numel()) for s in shapes)
            flat = torch.empty(numel, dtype=dtype, device=self.device)
            if e.mg in params:
                shard = params[e.mg].detach()
                tp, group = (self.etp, self.etp_group) if e.expert is not None else (self.tp, self.tp_group)
                if tp > 1 and e.kind != "replicated":
                    parts = [torch.empty_like(shard) for _ in range(tp)]
                    dist.all_gather(parts, shard.contiguous(), group=group)
                    full = tp_merge(e, parts)
                else:
                    full = shard
                if dist.get_rank() == handle.owners[e.mg]:
                    flat.copy_(torch.cat([t.reshape(-1) for _, t in megatron_to_hf(e, full, self.shape)]))
            dist.broadcast(flat, src=handle.owners[e.mg])
            offset = 0
            for name, s in zip(e.hf, shapes, strict=True):
                n = int(torch.Size(s).numel())
                piece = flat[offset : offset + n].view(s)
                yield name, piece if on_device else piece.to("cpu", torch.float32).contiguous()
                offset += n

    # ------------------------------------------------------------------ checkpoints
    def _sharded(self, handles: dict[str, _Handle], with_optim: dict[str, bool], loading: bool) -> dict[str, Any]:
        meta = {"distrib_optim_sharding_type": "fully_reshardable"}
        sd: dict[str, Any] = {}
        for role, h in handles.items():
            model_sd = h.model.sharded_state_dict(prefix=f"{role}.")
            sd[role] = {"model": model_sd}
            if with_optim[role]:
                sd[role]["optim"] = h.optim.sharded_state_dict(model_sd, is_loading=loading, metadata=meta)
        return sd

    def save(self, handles: dict[str, _Handle], path: str, with_optim: dict[str, bool]) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self._sharded(handles, with_optim, False), path)

    def load(self, handles: dict[str, _Handle], path: str, with_optim: dict[str, bool]) -> None:
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self._sharded(handles, with_optim, True), path)
        for role, h in handles.items():
            h.model.load_state_dict({k.removeprefix(f"{role}."): v for k, v in state[role]["model"].items()}, strict=False)
            if with_optim[role]:
                h.optim.load_state_dict(state[role]["optim"])

    def save_extra(self, path: str, extra: dict[str, Any]) -> None:
        rngs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, extra["rng"])
        if dist.get_rank() == 0:
            torch.save({**extra, "rng": rngs, "world_size": dist.get_world_size()}, os.path.join(path, "extra.pt"))
        dist.barrier()

    def load_extra(self, path: str) -> dict[str, Any] | None:
        p = os.path.join(path, "extra.pt")
        if not os.path.isfile(p):
            return None
        extra = torch.load(p, weights_only=False)
        rngs = extra["rng"]
        extra["rng"] = rngs[dist.get_rank()] if extra.get("world_size") == dist.get_world_size() else rngs[0]
        return extra

    def shared_tempdir(self) -> str:
        holder = [tempfile.mkdtemp(prefix="ferryman-megatron-state-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        return str(holder[0])

    def rng_state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if self.device.type != "cuda":
            return {"cpu": torch.get_rng_state()}
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.device),
                "tracker": get_cuda_rng_tracker().get_states()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
            get_cuda_rng_tracker().set_states(state["tracker"])

    # ------------------------------------------------------------------ colocated mode
    def offload(self, handles: dict[str, _Handle]) -> None:
        if self.config.optimizer_offload_fraction > 0:
            raise ValueError("trainer.optimizer_offload_fraction > 0 cannot be combined with colocated mode's offload(); "
                             "set it to 0 or run the trainer on its own GPUs")
        torch.cuda.synchronize(self.device)
        for h in handles.values():
            if h.optim is None:
                for p in h.module.parameters():
                    p.data = p.data.cpu()
                continue
            for buf in h.model.buffers + h.model.expert_parallel_buffers:
                buf.offload_to_cpu(move_params=True, move_grads=True)
            h.optim.offload_to_cpu()
        torch.cuda.empty_cache()

    def onload(self, handles: dict[str, _Handle]) -> None:
        for h in handles.values():
            if h.optim is None:
                for p in h.module.parameters():
                    p.data = p.data.to(self.device)
                continue
            for buf in h.model.buffers + h.model.expert_parallel_buffers:
                buf.reload_from_cpu(move_params=True, move_grads=True)
            h.optim.restore_from_cpu()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        global _USERS
        _USERS -= 1
        if _USERS == 0:
            with contextlib.suppress(Exception):
                self.ps.destroy_model_parallel()
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()
