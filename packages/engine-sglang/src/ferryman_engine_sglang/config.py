"""Configuration of the ``sglang`` engine (section ``engine`` of a run config).

Importing this module does not import SGLang, so a config can be validated on a machine
without a GPU or without SGLang installed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ferryman.config import PluginConfig

INSTALL_HINT = "uv sync --extra sglang in a ferryman checkout, or pip install 'ferryman-engine-sglang[sglang]' (Linux x86-64 with an NVIDIA GPU)"
"""How to install what the engine needs beyond this package."""

_RESERVED_SERVER_ARGS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "skip_tokenizer_init",
        "tp_size",
        "dtype",
        "mem_fraction_static",
        "max_total_tokens",
        "context_length",
        "max_running_requests",
        "chunked_prefill_size",
        "disable_radix_cache",
        "disable_cuda_graph",
        "disable_overlap_schedule",
        "random_seed",
        "enable_memory_saver",
        "enable_deterministic_inference",
        "enable_return_routed_experts",
        "base_gpu_id",
        "log_level",
    }
)


class SGLangEngineConfig(PluginConfig):
    """One engine replica = one in-process ``sglang.Engine`` (tensor parallel inside it)."""

    type: Literal["sglang"] = "sglang"
    """Selects this engine."""
    requires: ClassVar[dict[str, str]] = {"sglang": INSTALL_HINT}
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs of this replica (SGLang starts one scheduler process per GPU)."""
    base_gpu_id: int = Field(0, ge=0)
    """First GPU (of those visible to the process) that the replica's schedulers use."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations dtype (``auto``: the checkpoint's)."""
    mem_fraction_static: float = Field(0.8, gt=0.0, lt=1.0)
    """Fraction of the GPU for weights and the KV cache pool (SGLang's ``mem_fraction_static``)."""
    max_total_tokens: int | None = Field(None, ge=16)
    """Size the KV cache pool in tokens directly (overrides the fraction for the KV part)."""
    context_length: int | None = Field(None, ge=2)
    """Context length (prompt + generated); default: the model's."""
    max_running_requests: int | None = Field(None, ge=1)
    """Most requests decoded together (SGLang's default when unset)."""
    chunked_prefill_size: int | None = Field(None)
    """Token budget of one prefill chunk (SGLang's default when unset; -1 turns chunking off)."""
    radix_cache: bool = True
    """SGLang's radix (prefix) cache: a partial-rollout resume or the next agent turn prefills
    only what is new (``num_cached_prompt_tokens`` reports the hit)."""
    cuda_graph: bool = True
    """CUDA graphs for decoding (false: faster start, slower decoding)."""
    overlap_schedule: bool = True
    """SGLang's overlap scheduler (CPU scheduling of step k+1 while step k runs)."""
    memory_saver: bool = True
    """Start SGLang with its memory saver (``torch_memory_saver``), so that
    ``release_kv_cache`` frees the KV cache's GPU memory until ``resume_kv_cache``; without it
    they only flush the radix cache."""
    release_weights: bool = False
    """Colocated mode: ``release_kv_cache`` also frees the weights' GPU memory (SGLang's
    ``weights`` tag); the next ``load_weights`` (or ``resume_kv_cache``) brings it back first.
    Only with full-weight syncs: what is not loaded again keeps whatever the memory held."""
    pause_mode: Literal["abort", "keep", "in_place"] = "abort"
    """What ``pause(abort=True)`` does. ``abort``: in-flight requests return now with
    ``stop_reason="aborted"`` (the server client resends them; the radix cache makes that
    cheap). ``keep``: in-flight requests are aborted inside SGLang but their ``generate()``
    calls stay open; after ``resume()`` each is resubmitted (prompt + tokens so far, its
    remaining budget) and continues in the same call, its KV recomputed with the new weights.
    ``in_place``: SGLang's ``pause_generation(mode="in_place")``: requests stay frozen in
    SGLang's batch with their KV cache (computed by the old weights) and continue after
    ``resume()``; the radix cache cannot be flushed while they run (see the README).
    ``pause(abort=False)`` always drains."""
    deterministic: bool = False
    """SGLang's ``enable_deterministic_inference``: batch-invariant kernels and seeded
    sampling. SGLang honours ``SamplingParams.seed`` only in this mode."""
    return_routed_experts: bool = False
    """Ask SGLang for the experts each position was routed to (MoE models) and return them in
    ``TokenOutput.routed_experts`` (``[positions][layers][top_k]``, prompt and output)."""
    log_level: str = "error"
    """SGLang's log level (its loggers, in this process and the schedulers)."""
    server_args: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments for SGLang's ``ServerArgs`` (e.g. ``attention_backend``,
    ``page_size``, ``cuda_graph_max_bs_decode``), passed as given. Fields set above cannot be given
    here."""

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineConfig:
        clash = sorted(set(self.server_args) & _RESERVED_SERVER_ARGS)
        if clash:
            raise ValueError(
                f"server_args: {clash} are set by their own fields of the sglang engine config; "
                "set them there instead"
            )
        if self.release_weights and not self.memory_saver:
            raise ValueError("release_weights: needs memory_saver: true (SGLang frees memory through it)")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size: must be >= 1, or -1 (no chunking)")
        return self

    def engine_kwargs(self, *, model_path: str, seed: int) -> dict[str, Any]:
        """Keyword arguments for ``sglang.Engine`` (SGLang's ``ServerArgs``)."""
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "tokenizer_path": model_path,
            # token ids in, token ids out: no tokenizer, no detokenizer process; outputs go
            # from the scheduler straight to this process (EOS from the model's config)
            "skip_tokenizer_init": True,
            "tp_size": self.tensor_parallel_size,
            "base_gpu_id": self.base_gpu_id,
            "dtype": self.dtype,
            "mem_fraction_static": self.mem_fraction_static,
            "disable_radix_cache": not self.radix_cache,
            "disable_cuda_graph": not self.cuda_graph,
            "disable_overlap_schedule": not self.overlap_schedule,
            "random_seed": int(seed),
            "enable_memory_saver": self.memory_saver,
            "enable_deterministic_inference": self.deterministic,
            "log_level": self.log_level,
        }
        if self.max_total_tokens is not None:
            kwargs["max_total_tokens"] = self.max_total_tokens
        if self.context_length is not None:
            kwargs["context_length"] = self.context_length
        if self.max_running_requests is not None:
            kwargs["max_running_requests"] = self.max_running_requests
        if self.chunked_prefill_size is not None:
            kwargs["chunked_prefill_size"] = self.chunked_prefill_size
        if self.return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(self.server_args)
        return kwargs
