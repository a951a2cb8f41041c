"""Configuration of the ``vllm`` engine (section ``engine`` of a run config).

Importing this module does not import vLLM, so a config can be validated on a machine
without a GPU or without vLLM installed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ferryman.config import PluginConfig

INSTALL_HINT = "uv sync --extra vllm in a ferryman checkout, or pip install 'ferryman-engine-vllm[vllm]' (Linux x86-64 with an NVIDIA GPU)"
"""How to install what the engine needs beyond this package."""

WORKER_EXTENSION = "ferryman_engine_vllm.worker.FerrymanWorkerExtension"
"""Mixed into vLLM's GPU worker: gives it the method that loads streamed weight buckets."""

_RESERVED_ENGINE_KWARGS = frozenset(
    {
        "model",
        "tokenizer",
        "seed",
        "dtype",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "enforce_eager",
        "enable_sleep_mode",
        "logprobs_mode",
        "worker_extension_cls",
        "enable_return_routed_experts",
        "skip_tokenizer_init",
        "async_scheduling",
    }
)


class VLLMEngineConfig(PluginConfig):
    """One engine replica = one vLLM engine (tensor parallel inside the replica)."""

    type: Literal["vllm"] = "vllm"
    """Selects this engine."""

    requires: ClassVar[dict[str, str]] = {"vllm": INSTALL_HINT}
    core: Literal["thread", "process"] = "thread"
    """Where vLLM's engine core runs. ``thread``: in this process, stepped by one dedicated
    thread (vLLM's ``LLMEngine`` with its in-process core client); nothing else is started
    when ``tensor_parallel_size`` is 1. ``process``: vLLM's ``AsyncLLM``, which runs the engine
    core in a child process and talks to it over ZeroMQ."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs of this replica (vLLM starts one worker process per GPU when > 1)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations dtype (``auto``: the checkpoint's)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of the GPU vLLM may take (weights + activations + KV cache)."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """Size the KV cache directly instead of from ``gpu_memory_utilization`` (vLLM then skips
    its memory profiling; useful when several engines share a GPU)."""
    max_model_len: int | None = Field(None, ge=2)
    """Context length (prompt + generated); default: the model's."""
    max_num_seqs: int = Field(256, ge=1)
    """Most requests scheduled together."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Token budget of one scheduler step. Unset: vLLM's default for an engine built as both
    cores build theirs (``UsageContext.ENGINE_CONTEXT``), which in vLLM 0.24 is 2048 tokens,
    while vLLM's own offline ``LLM`` takes 16384 on a GPU of >= 70 GiB (8192 on smaller ones).
    Set it to compare with ``LLM`` like for like (``bench/engine_repeated.py`` sets 16384 for
    every engine)."""
    enable_prefix_caching: bool = True
    """vLLM's automatic prefix caching (block hashes): a partial-rollout resume or the next
    turn of an agent prefills only what is new."""
    enforce_eager: bool = False
    """No torch.compile and no CUDA graphs (faster start, slower decoding)."""
    sleep_mode: bool = True
    """``release_kv_cache`` puts vLLM to sleep (KV cache memory freed, weights kept resident)
    and ``resume_kv_cache`` wakes it; without it they only reset the prefix cache."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level used by ``release_kv_cache``. 1: the weights are copied to CPU and back,
    so a partial weight update is safe. 2: the weights are discarded and their memory
    re-allocated empty, so every parameter must then be loaded (the full-weights syncs that
    ferryman's transports do)."""
    pause_mode: Literal["abort", "keep"] = "abort"
    """What ``pause(abort=True)`` does. ``abort``: in-flight requests return now with
    ``stop_reason="aborted"`` (the server client resends them; the prefix cache makes that
    cheap). ``keep``: in-flight requests are frozen inside vLLM and continue after ``resume()``
    within the same ``generate()`` call; tokens after the update carry the new version and
    their KV is recomputed with the new weights. ``pause(abort=False)`` always drains."""
    return_routed_experts: bool = False
    """Ask vLLM for the experts each token was routed to (MoE models) and return them in
    ``TokenOutput.routed_experts``."""
    stream_tokens: bool = False
    """``core: thread`` only. ``false`` (default): vLLM reports a request once, when it ends
    (``RequestOutputKind.FINAL_ONLY``, as vLLM's own offline ``LLM.generate``); an abort or a
    ``keep`` freeze reads the tokens made so far from vLLM's request state, so partial rollout
    and per-token weight versions are the same. ``true``: every engine step reports every
    running request's new tokens (``DELTA``), which costs one output object per request per
    step on the core thread and one hand-over on the event loop (``bench/engine.py`` row
    ``vllm-stream``). The ``process`` core always streams."""
    async_scheduling: bool | None = None
    """vLLM's async scheduling: the next batch is scheduled while the GPU runs the current one.
    ``None`` (default): vLLM's own default, on where vLLM supports it, with either core. On the
    H200 the thread core makes 1.44x the tokens/s with it than without (``bench/engine.py`` rows
    ``vllm`` and ``vllm:on``, ``bench/results/engine.md``). With the thread core, every weight
    load, sleep, wake-up, prefix-cache reset and ``keep`` freeze first finishes the batch still
    on the GPU (scheduling paused meanwhile) and hands out its tokens, so none of them meets a
    running batch and the tokens keep the version of the weights that made them (the GPU tests
    pass with it). ``false``: every ``step()`` returns after its batch ran."""
    step_delay_s: float = Field(0.0, ge=0.0)
    """Artificial delay after every engine step (``core: thread`` only; for tests of async
    behaviour)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments for vLLM's ``EngineArgs`` (e.g. ``block_size``,
    ``attention_backend``), passed as given. Fields set above cannot be given here."""

    @model_validator(mode="after")
    def _check(self) -> VLLMEngineConfig:
        clash = sorted(set(self.engine_kwargs) & _RESERVED_ENGINE_KWARGS)
        if clash:
            raise ValueError(
                f"engine_kwargs: {clash} are set by their own fields of the vllm engine config; "
                "set them there instead"
            )
        if self.step_delay_s > 0 and self.core != "thread":
            raise ValueError("step_delay_s: only supported with core: thread")
        return self

    def engine_args(self, *, model_path: str, seed: int) -> dict[str, Any]:
        """Keyword arguments for vLLM's ``EngineArgs`` / ``AsyncEngineArgs``."""
        args: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "seed": int(seed),
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager,
            "enable_sleep_mode": self.sleep_mode,
            # log-probs of the distribution the token was drawn from (temperature applied)
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            # token ids in, token ids out: no tokenizer, no detokenizing (EOS comes from the
            # model's generation_config.json)
            "skip_tokenizer_init": True,
        }
        if self.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.return_routed_experts:
            args["enable_return_routed_experts"] = True
        if self.async_scheduling is not None:
            args["async_scheduling"] = self.async_scheduling
        args.update(self.engine_kwargs)
        return args
