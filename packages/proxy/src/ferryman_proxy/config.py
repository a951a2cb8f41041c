"""Configuration of the proxy (:class:`ProxyConfig`).

A pydantic model with the project's strictness (unknown fields are errors), so that it can be
embedded in an env plugin's config section (``env.proxy: {...}``) and validated there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferryman.config import Strict

ToolParserName = Literal["hermes", "qwen3_coder", "none"]


class ProxyConfig(Strict):
    """How the proxy listens, parses and limits sessions."""

    host: str = "127.0.0.1"
    """Interface to listen on. Loopback by default: sandboxes reach it through a port forward
    or a shared network namespace. Set ``0.0.0.0`` only on a trusted network."""
    advertise_host: str | None = None
    """The address put in each session's ``base_url`` (what a sandbox connects to). ``null``:
    ``host`` itself, or, when ``host`` is a wildcard (``0.0.0.0``, ``::``), this node's address
    as Ray sees it (``127.0.0.1`` outside Ray). On a cluster, sandboxes on other nodes need
    ``host: 0.0.0.0`` (or this node's address); the session secret in the URL still guards every
    session."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one (``ProxyServer.url`` tells which)."""
    model_name: str = Field("ferryman-policy", min_length=1)
    """The model name the proxy answers to (``GET /v1/models``; requests naming another model get
    404). LiteLLM callers use ``openai/<model_name>`` or ``hosted_vllm/<model_name>``."""
    tool_parser: ToolParserName = "hermes"
    """How tool calls are read from the model's text: ``hermes`` (JSON inside ``<tool_call>``
    tags, Qwen2.5 style), ``qwen3_coder`` (``<function=…><parameter=…>`` XML inside
    ``<tool_call>`` tags) or ``none`` (text only)."""
    chat_template: str | None = None
    """Override the tokenizer's chat template: a Jinja template, or the name of one shipped in
    :mod:`ferryman_proxy.templates` (``chatml_hermes``, ``qwen3_coder``). ``None`` keeps the
    tokenizer's own."""
    sampling_from: Literal["session", "request"] = "session"
    """``session``: temperature and top-p come from the rollout side's ``SamplingParams`` (what
    the trainer assumes when it scores the tokens); the agent's values are validated and ignored.
    ``request``: the agent's values win where given. Either way the agent's ``max_tokens`` is
    capped by the session's, and ``stop`` and ``seed`` are honoured."""
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    """Largest request body accepted (413 above)."""
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    """Longest request line and longest header field accepted (400 above)."""
    max_requests_per_minute: int | None = Field(None, ge=1)
    """Requests one session may make in any minute (a token bucket refilled evenly); above it
    429 ``rate_limit_exceeded`` (LiteLLM's RateLimitError). ``None``: no rate limit."""
    max_concurrent_requests: int | None = Field(8, ge=1)
    """Requests of one session in flight at once; more get 429 ``too_many_concurrent_requests``.
    ``None``: unbounded."""
    max_turns: int | None = Field(None, ge=1)
    """Chat-completion calls a session may make; the next one is refused (400,
    ``session_ended``) and the session ends with reason ``max_turns``."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Context length of a session: the most tokens its trajectory (prompt + response) may hold.
    Generation budgets are cut to fit; a request whose prompt leaves no room is refused (400,
    ``context_length_exceeded``) and the session ends with reason ``context_length``."""
    max_consecutive_no_tool: int | None = Field(None, ge=1)
    """End the session (reason ``no_tool_calls``) after this many answers in a row without a
    tool call; the answer that reaches the limit is still returned."""
    debug_dir: str | None = None
    """Where a JSON file describing each history mismatch is written (the agent changed its
    history, so a new trajectory segment starts). ``None``: a ``ferryman-proxy`` folder in the
    system's temporary directory."""
    stream_chunk_chars: int = Field(64, ge=1)
    """Streaming answers send the content in pieces of at most this many characters."""
    live_streaming: bool = True
    """Stream an answer while the engine generates it (when the generate client takes
    ``on_tokens``, as core's ``ServerClient`` does). ``False``: the stream is sent once the
    answer is complete."""

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be an interface address such as 127.0.0.1")
        return v

    @field_validator("advertise_host")
    @classmethod
    def _advertise_not_wildcard(cls, v: str | None) -> str | None:
        if v is not None and v.strip() in ("", "0.0.0.0", "::"):
            raise ValueError(f"{v!r} is not an address a sandbox can connect to; give this node's address or null")
        return v
