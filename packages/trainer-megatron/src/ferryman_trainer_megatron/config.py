"""Configuration of the ``megatron`` trainer backend. Validates without Megatron installed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ferryman.config import PluginConfig

__all__ = ["MegatronTrainerConfig", "MEGATRON_EXTRA", "MEGATRON_REQUIREMENT"]

MEGATRON_REQUIREMENT = "megatron-core>=0.19.2,<0.20"
"""The megatron-core release line this backend is written against (its API is read from 0.19.2)."""
MEGATRON_EXTRA = "ferryman-trainer-megatron[megatron]"
"""The extra that installs it."""


class MegatronTrainerConfig(PluginConfig):
    """Configuration of the ``megatron`` trainer backend (``trainer:`` section of a run config).

    The world (``torchrun`` ranks, or one process) is cut into
    ``tensor × pipeline × context × data`` parallel groups by Megatron's
    ``parallel_state.initialize_model_parallel``; the data-parallel size is what is left:
    ``world / (tensor × pipeline × context)``. Experts of a MoE model are spread over
    ``expert_parallel_size`` ranks of the data × context group."""

    type: Literal["megatron"] = "megatron"
    lr: float = Field(1e-5, ge=0)
    """Actor learning rate (Adam with decoupled weight decay, Megatron's optimizer)."""
    critic_lr: float = Field(1e-5, ge=0)
    """Critic learning rate; used only with ``use_critic``."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (actor and critic)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam ``(beta1, beta2)``."""
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    """Maximum global gradient norm (over every parallel group); 0 disables clipping."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch in ``update_actor`` / ``update_critic``."""
    micro_batch_max_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch (rows sorted by length, ``rows × longest row`` at most
    this; a longer row alone). Gradients accumulate over micro-batches, weighted so that the
    step is the one of the whole mini-batch."""
    log_prob_chunk_tokens: int = Field(1024, ge=1)
    """Log-probs and entropies are computed from the vocab-parallel logits this many positions
    at a time in float32, forward and backward: no float32 copy of the logits shard is made."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the model parameters in forward/backward. With ``bfloat16`` the optimizer keeps
    float32 main weights and states (Megatron's mixed-precision optimizer)."""
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    """Context parallelism: every row's sequence split over this many ranks (Megatron's
    load-balanced layout: ``2 × cp`` chunks, rank ``r`` holding chunks ``r`` and ``2·cp − 1 − r``;
    rows are right-padded to a multiple of ``2 × cp``). Attention: Transformer Engine's own
    context-parallel attention with ``transformer_engine``; with the local spec, the ``sdpa``
    core attention all-gathers keys and values over the group. Per-token log-probs, entropies
    and values are gathered back to whole rows, so the losses are unchanged. Activation memory
    per rank falls about ``cp``-fold (keys and values of the whole sequence excepted)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Experts of a MoE model spread over this many ranks (must divide the expert count)."""
    expert_tensor_parallel_size: int = Field(1, ge=1)
    """Tensor parallelism inside each expert (1: every expert whole on its rank)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (activations split along the sequence between the tensor
    parallel ranks outside attention/MLP); needs ``tensor_parallel_size > 1`` and
    ``transformer_impl: transformer_engine`` (the local spec's torch RMSNorm refuses it)."""
    use_distributed_optimizer: bool = True
    """Shard the optimizer states (and float32 main weights) over the data-parallel ranks."""
    optimizer_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the optimizer (float32 main weights and Adam states, by element count) kept in
    host memory and stepped there by torch's AdamW (Megatron's ``HybridDeviceOptimizer``,
    ``optimizer_cpu_offload``); the rest stays on the GPU. 0: all on the GPU. With bf16
    parameters the GPU holds 18 bytes per parameter without offload (bf16 weight, float32 main
    gradient, main weight and two Adam moments; 16 with ``optimizer_param_remainders``) and ``6 + 12 × (1 - fraction)`` with it: what
    lets a 7B model train on one 141 GB GPU. Costs a host step and two PCIe copies of the offloaded
    share per optimizer step. Needs ``use_distributed_optimizer``; not with colocated mode's
    ``offload()``."""
    optimizer_param_remainders: bool | None = None
    """Keep the float32 main weights as the 16 low bits that the bf16 weights lack (Transformer
    Engine's ``FusedAdam`` with ``store_param_remainders``, Megatron's precision-aware
    optimizer): the same float32 values, rebuilt exactly at each step, in 2 bytes per parameter
    instead of 4, so the GPU holds 16 bytes per parameter instead of 18 (7B: 14 GB less, what
    lets it train on one 141 GB GPU with no offload). ``None``: on with
    ``transformer_impl: transformer_engine``, bf16 parameters, the distributed optimizer and no
    optimizer offload; otherwise off. ``true`` needs all of these."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer spec: ``local`` (Megatron-core's own modules, no extra dependency) or
    ``transformer_engine`` (TE's fused modules; needs the ``megatron-te`` extra). See the
    README for what the local spec cannot do."""
    rope_fusion: bool = False
    """Transformer Engine's fused RoPE kernel (``apply_rope_fusion``; ``transformer_engine``
    only). Off by default: at the Qwen2.5-1.5B shape in bf16 on the H200 it moved log-probs
    1.54e-2 (mean) from the Hugging Face model's, against 5.5e-3 with Megatron's RoPE in torch
    (``bench/results/gpu_megatron_te.md``)."""
    local_attention: Literal["sdpa", "dot_product"] = "sdpa"
    """Core attention of the ``local`` spec: ``sdpa`` (PyTorch's fused scaled-dot-product
    attention, causal, no ``[seq, seq]`` tensors; flash kernels on GPUs) or ``dot_product``
    (Megatron's ``DotProductAttention``, which materialises ``[batch, heads, seq, seq]`` scores
    and probabilities: 3 GiB per layer at 8k tokens for a 1.5B shape). Not used with
    ``transformer_engine``."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recomputation: ``full`` recomputes whole layers (``recompute_num_layers`` of
    them per pipeline stage, each layer checkpointed on its own: Megatron's ``block`` method),
    ``selective`` only core attention."""
    recompute_num_layers: int | None = Field(None, ge=1)
    """With ``recompute: full``: layers recomputed per stage (``None``: all of them)."""
    make_vocab_size_divisible_by: int = Field(128, ge=1)
    """The embedding and output layer are padded to a multiple of this × the tensor-parallel
    size (Megatron's rule); padded rows are zero on load, masked to -inf in the log-softmax, and
    stripped on export."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    """MoE load-balancing auxiliary loss coefficient (0: no load-balancing loss)."""
    router_replay: bool = False
    """MoE router replay: every forward routes each token to the experts the rollout engine
    chose (``batch.meta["routed_experts"]``, ``[B, T, moe layers, top-k]``) instead of its own
    top-k, so that trainer and engine agree on the experts (Megatron's ``RouterReplay``)."""
    use_critic: bool = False
    """Build a value model (same backbone, scalar value head). Needed by GAE."""
    critic_warmup: int = Field(0, ge=0)
    """With a critic: ``update_actor`` does nothing until ``update_critic`` ran this often."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warmup over this many optimizer steps; 0 = constant."""
    num_workers: int = Field(1, ge=1)
    """Megatron ranks. 1: this process is the only rank, or ``torchrun`` started the ranks. N > 1:
    the factory returns a :class:`~ferryman_trainer_megatron.ray_group.RayMegatronGroup` of N Ray
    actors in one placement group (one rank and ``num_gpus_per_worker`` GPUs each), driven as one
    backend; N must be a multiple of tensor × pipeline × context parallelism (the rest is data
    parallelism)."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved for each rank's bundle (``num_workers > 1``)."""
    num_gpus_per_worker: float = Field(1.0, gt=0)
    """GPUs reserved for each rank's bundle (``num_workers > 1``)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy of the rank bundles (``PACK``: ranks packed per node, which keeps
    tensor-parallel neighbours on one node)."""
    worker_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources in each rank's bundle, e.g. ``{trainer_node: 1}``."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for Ray to place the bundles before failing with the cluster's resources."""
    device: Literal["cuda"] = "cuda"
    """Megatron-core trains on CUDA GPUs only (``cuda:LOCAL_RANK`` per rank)."""
    backend: Literal["nccl"] = "nccl"
    """torch.distributed backend when the trainer creates the process group."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each Adam beta must be in [0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _context_parallel_needs_a_causal_fused_attention(self) -> MegatronTrainerConfig:
        if self.context_parallel_size > 1 and self.transformer_impl == "local" and self.local_attention != "sdpa":
            raise ValueError(
                "trainer.context_parallel_size > 1 needs trainer.local_attention: sdpa (or trainer.transformer_impl: "
                "transformer_engine): Megatron's DotProductAttention has no context parallelism"
            )
        return self

    @model_validator(mode="after")
    def _workers_hold_whole_model_replicas(self) -> MegatronTrainerConfig:
        if self.num_workers > 1 and self.num_workers % self.model_parallel_size:
            raise ValueError(
                f"trainer.num_workers ({self.num_workers}) must be a multiple of tensor × pipeline × context "
                f"parallelism ({self.model_parallel_size})"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp_and_te(self) -> MegatronTrainerConfig:
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("trainer.sequence_parallel needs trainer.tensor_parallel_size > 1")
        if self.sequence_parallel and self.transformer_impl != "transformer_engine":
            # the local spec's RMSNorm is Megatron's WrappedTorchNorm, which asserts at build time
            raise ValueError("trainer.sequence_parallel needs trainer.transformer_impl: transformer_engine "
                             "(the local spec's RMSNorm, torch's, has no sequence parallelism)")
        return self

    @model_validator(mode="after")
    def _optimizer_offload_needs_distributed_optimizer(self) -> MegatronTrainerConfig:
        if self.optimizer_offload_fraction > 0 and not self.use_distributed_optimizer:
            raise ValueError("trainer.optimizer_offload_fraction > 0 needs trainer.use_distributed_optimizer: true "
                             "(Megatron offloads the distributed optimizer's shards)")
        return self

    @model_validator(mode="after")
    def _rope_fusion_needs_te(self) -> MegatronTrainerConfig:
        if self.rope_fusion and self.transformer_impl != "transformer_engine":
            raise ValueError("trainer.rope_fusion needs trainer.transformer_impl: transformer_engine "
                             "(the local spec has no fused RoPE)")
        return self

    def _remainders_lack(self) -> list[str]:
        """The settings that main-weight remainders need and this config does not have."""
        return [what for what, ok in [
            ("transformer_impl: transformer_engine", self.transformer_impl == "transformer_engine"),
            ("param_dtype: bfloat16", self.param_dtype == "bfloat16"),
            ("use_distributed_optimizer: true", self.use_distributed_optimizer),
            ("optimizer_offload_fraction: 0", self.optimizer_offload_fraction == 0),
        ] if not ok]

    @model_validator(mode="after")
    def _param_remainders_need_te_bf16_and_distributed_optimizer(self) -> MegatronTrainerConfig:
        missing = self._remainders_lack() if self.optimizer_param_remainders else []
        if missing:
            raise ValueError("trainer.optimizer_param_remainders: true needs " + ", ".join(f"trainer.{m}" for m in missing)
                             + " (Transformer Engine's FusedAdam keeps the remainders of bf16 weights)")
        return self

    @property
    def param_remainders(self) -> bool:
        """Whether :attr:`optimizer_param_remainders` is in effect (``None``: wherever it can be)."""
        if self.optimizer_param_remainders is not None:
            return self.optimizer_param_remainders
        return not self._remainders_lack()

    @model_validator(mode="after")
    def _recompute_layers_need_full(self) -> MegatronTrainerConfig:
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ValueError("trainer.recompute_num_layers is only used with trainer.recompute: full")
        return self

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: tensor × pipeline × context."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
