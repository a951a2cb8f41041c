"""The aiohttp server: routes, OpenAI-style error bodies, JSON and SSE answers.

Routes (``{secret}`` is a session's unguessable id; nothing lists sessions):

* ``POST /sess/{secret}/v1/chat/completions``
* ``GET  /sess/{secret}/v1/models`` and ``GET /sess/{secret}/v1/models/{model}``

Everything else is 404, a wrong method 405, a body over ``max_body_bytes`` 413 (after
decompression: ``Content-Encoding`` ``gzip`` and ``deflate`` are read, any other is a 415), each
with an ``{"error": {...}}`` body; no input gets a 5xx (a 5xx is a fault of the proxy or the
engines, counted in ``errors_5xx``). Answers follow OpenAI's chat-completion format plus vLLM's
extensions: with ``"return_token_ids": true`` the response carries ``prompt_token_ids`` (the
whole prompt of this turn) and the choice ``token_ids`` (the tokens the model produced);
``"logprobs": true`` gives ``choices[0].logprobs.content[i].logprob`` for each of those tokens.

A streamed answer (``"stream": true``) is sent as server-sent events: a role chunk, the content
in pieces, the tool calls, a final chunk with ``finish_reason``, a usage chunk if
``stream_options.include_usage``, and ``data: [DONE]``. When the generate client takes
``on_tokens`` (core's ``ServerClient`` does; see :mod:`ferryman.streaming`) the stream is live:
it opens with the first generated token and sends the content as it is decoded, holding back
whatever could still turn out to be a tool call or a stop string
(:mod:`ferryman_proxy.streaming`); the held-back rest, the tool calls and the vLLM-style
extras (``prompt_token_ids``, ``token_ids``, ``logprobs``) follow once the answer is complete,
so the streamed content always adds up to the non-streamed answer's ``content``. An engine
that cannot stream gives its tokens when it is done, and so does a client without
``on_tokens`` (then the whole stream is written at once, as before). An error after the stream
opened is sent as a ``data: {"error": {...}}`` event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import zlib
from collections import deque
from typing import Any

from aiohttp import web

from ferryman.protocols import GenerateClient
from ferryman.streaming import accepts_on_tokens
from ferryman.types import SamplingParams, TokenOutput

from ferryman_proxy._fast import dumpb, loads, random_hex
from ferryman_proxy.config import ProxyConfig
from ferryman_proxy.errors import ProxyError, bad_request
from ferryman_proxy.messages import lone_surrogate_at, parse_chat_request
from ferryman_proxy.parsers import get_parser
from ferryman_proxy.session import Session, SessionResult, TurnResult
from ferryman_proxy.streaming import IncrementalDecoder, content_limit
from ferryman_proxy.templates import resolve_template
from ferryman_proxy.tokenization import ChatTokenizer

log = logging.getLogger(__name__)

__all__ = ["ProxyServer"]

_SERVER_KEY: web.AppKey[ProxyServer] = web.AppKey("ferryman_proxy", "ProxyServer")
_STATUS_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def _error_response(status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> web.Response:  # noqa: A002
    return web.json_response({"error": {"message": message, "type": type, "param": param, "code": code}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:
            msg = f"request body too large (limit {request.app[_SERVER_KEY].config.max_body_bytes} bytes)"
            return _error_response(413, msg, code="request_too_large")
        return _error_response(e.status, e.reason or "error", type=_STATUS_TYPES.get(e.status, "invalid_request_error"))
    except Exception:  # noqa: BLE001 - never a traceback to the agent
        log.exception("proxy: unhandled error on %s %s", request.method, request.path)
        request.app[_SERVER_KEY].counters["errors_5xx"] += 1
        return _error_response(500, "internal proxy error", type="server_error")


def _decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """The body in ``Content-Encoding`` ``encoding``, decoded, at most ``limit`` bytes (a
    small body must not inflate past the size limit); a 4xx for anything else."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return raw
    if enc not in ("gzip", "x-gzip", "deflate"):
        raise ProxyError(415, f"Content-Encoding {encoding!r} is not supported (send gzip, deflate or none)", code="unsupported_content_encoding")
    # gzip: a gzip header; deflate: zlib-wrapped, or (as some clients send) raw
    candidates = (16 + zlib.MAX_WBITS,) if enc != "deflate" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    for wbits in candidates:
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(raw, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise ProxyError(413, f"request body too large after decompression (limit {limit} bytes)", code="request_too_large")
        if d.eof and not d.unused_data:
            return out
    raise bad_request(f"the request body is not valid {enc} data (Content-Encoding: {encoding})")


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The address sessions' URLs name: ``advertise`` if given; ``host`` unless it is a
    wildcard; else this node's address as Ray sees it (so sandboxes on other nodes of a
    cluster reach it), or loopback outside Ray."""
    if advertise:
        return advertise
    if host not in ("0.0.0.0", "::", ""):
        return host
    import sys

    if "ray" in sys.modules:
        try:
            import ray

            if ray.is_initialized():
                return str(ray.util.get_node_ip_address())
        except Exception:  # noqa: BLE001 - fall back to loopback
            pass
    return "127.0.0.1"


class ProxyServer:
    """An OpenAI-compatible endpoint on the running event loop, one session per agent run.

    ``tokenizer`` is the policy's transformers tokenizer (its chat template, or
    ``config.chat_template``); ``client`` is what generates (core's ``ServerClient``), and may
    instead be given per session.
    """

    def __init__(self, *, tokenizer: Any, client: GenerateClient | None = None, config: ProxyConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.client = client
        self.config = config or ProxyConfig()
        self.chat_tokenizer = ChatTokenizer(tokenizer, resolve_template(self.config.chat_template))
        if not self.chat_tokenizer.incremental:
            log.warning(
                "proxy: the chat template failed the incremental self-check (%s); every turn is re-tokenized in full",
                self.chat_tokenizer.probe_error,
            )
        self.parser = get_parser(self.config.tool_parser)
        self.url: str | None = None
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.overheads_s: deque[float] = deque(maxlen=100_000)
        """Per answered request, the proxy's own time: from the request body in hand to the
        response ready (JSON decoding, validation, tokenization, parsing, encoding), less the
        time spent awaiting the engine."""
        self.overhead_cpu_s: deque[float] = deque(maxlen=100_000)
        """The same span in CPU time of the event loop's thread (unaffected by other processes
        competing for the CPU), less the thread's CPU time while awaiting the engine."""
        self.encode_times_s: deque[float] = deque(maxlen=100_000)
        """Per answered request, the CPU time of the tokenizer's ``encode`` within the overhead."""
        self.counters: dict[str, int] = {"requests": 0, "answered": 0, "errors_4xx": 0, "errors_5xx": 0, "sessions_opened": 0,
                                        "live_streams": 0, "stream_errors": 0, "stream_mismatches": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on ``config.host:config.port`` on the running loop; sets ``url``."""
        if self._runner is not None:
            raise RuntimeError("ProxyServer.start: already started")
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[_errors])
        app[_SERVER_KEY] = self
        app.router.add_post("/sess/{secret}/v1/chat/completions", self._chat)
        app.router.add_get("/sess/{secret}/v1/models", self._models)
        app.router.add_get("/sess/{secret}/v1/models/{model:.+}", self._model)
        # the body is decompressed by the handler (_decompress): aiohttp's own decoding answers
        # a body that is not what its Content-Encoding says with a 500 or a plain-text 400
        limit = self.config.max_header_bytes
        runner = web.AppRunner(app, access_log=None, auto_decompress=False, max_line_size=limit, max_field_size=limit)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        self._runner = runner
        sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001 - the bound port
        port = sockets[0].getsockname()[1] if sockets else self.config.port
        host = advertised_host(self.config.host, self.config.advertise_host)
        if ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for sess in self._sessions.values():
            sess.closed = True
        self._sessions.clear()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # ------------------------------------------------------------------ sessions (rollout side)
    def open_session(self, request_id: str, params: SamplingParams, *, client: GenerateClient | None = None) -> Session:
        """A new session with an unguessable id (192 random bits); ``client`` overrides the
        server's client for this session. All of the session's engine calls use ``request_id``
        (so the router keeps it on one replica)."""
        if self.url is None:
            raise RuntimeError("ProxyServer.open_session: call start() first")
        if client is None and self.client is None:
            raise ValueError("ProxyServer.open_session: no generate client (give one to the server or the session)")
        secret = secrets.token_urlsafe(24)
        sess = Session(
            secret=secret,
            request_id=request_id,
            params=params,
            base_url=f"{self.url}/sess/{secret}/v1",
            model_name=self.config.model_name,
            client=client or self.client,
            chat_tokenizer=self.chat_tokenizer,
            parser=self.parser,
            config=self.config,
        )
        self._sessions[secret] = sess
        self.counters["sessions_opened"] += 1
        return sess

    async def close_session(self, session: Session) -> SessionResult:
        """End the session (later requests get 404; a request still running is not recorded)
        and return its trajectory segments."""
        self._sessions.pop(session.secret, None)
        session.closed = True
        return session.result()

    def stats(self) -> dict[str, float]:
        out = {f"proxy/{k}": float(v) for k, v in self.counters.items()}
        out["proxy/sessions_open"] = float(len(self._sessions))
        if self.overheads_s:
            xs = sorted(self.overheads_s)
            out["proxy/overhead_ms_p50"] = 1e3 * xs[len(xs) // 2]
            out["proxy/overhead_ms_p99"] = 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return out

    # ------------------------------------------------------------------ handlers
    def _session(self, request: web.Request) -> Session:
        sess = self._sessions.get(request.match_info["secret"])
        if sess is None:
            raise ProxyError(404, "unknown or closed session", type="not_found_error", code="session_not_found")
        return sess

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._session(request)
        if request.match_info["model"] != self.config.model_name:
            raise ProxyError(404, f"The model {request.match_info['model']!r} does not exist", type="not_found_error", code="model_not_found")
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "ferryman"}

    def _admit(self, sess: Session) -> None:
        """Per-session request limits: in flight at once and per minute (429 above either)."""
        cfg = self.config
        if cfg.max_concurrent_requests is not None and sess.in_flight >= cfg.max_concurrent_requests:
            sess.counters["rate_limited"] += 1
            raise ProxyError(429, f"more than {cfg.max_concurrent_requests} requests of this session at once",
                             type="rate_limit_error", code="too_many_concurrent_requests")
        if cfg.max_requests_per_minute is not None:
            now = time.monotonic()
            rate = cfg.max_requests_per_minute / 60.0
            tokens, last = sess.bucket if sess.bucket is not None else (float(cfg.max_requests_per_minute), now)
            tokens = min(float(cfg.max_requests_per_minute), tokens + (now - last) * rate)
            if tokens < 1.0:
                sess.bucket = (tokens, now)
                sess.counters["rate_limited"] += 1
                raise ProxyError(429, f"this session is over {cfg.max_requests_per_minute} requests per minute",
                                 type="rate_limit_error", code="rate_limit_exceeded")
            sess.bucket = (tokens - 1.0, now)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests"] += 1
        sess: Session | None = None
        try:
            sess = self._session(request)
            self._admit(sess)
        except ProxyError as e:
            self._count_error(e, sess)
            raise
        sess.in_flight += 1
        try:
            return await self._chat_admitted(request, sess)
        finally:
            sess.in_flight -= 1

    async def _chat_admitted(self, request: web.Request, sess: Session) -> web.StreamResponse:
        try:
            raw = await request.read()
            t_body, c_body = time.perf_counter(), time.thread_time()
            encoding = request.headers.get("Content-Encoding")
            if encoding:
                raw = _decompress(raw, encoding, self.config.max_body_bytes)
            try:
                body = loads(raw)
            except (ValueError, RecursionError) as e:
                raise bad_request(f"the request body is not valid JSON: {e}") from None
            where = lone_surrogate_at(raw, body)
            if where is not None:  # JSON can escape one (\ud800); no tokenizer can encode it
                raise bad_request(f"{where} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text", param=where)
            req = parse_chat_request(body, self.config.model_name, sess.known)
            if req.stream and self.config.live_streaming and sess.client is not None and accepts_on_tokens(sess.client):
                return await self._stream_live(request, req, sess, t_body, c_body)
            turn = await sess.chat(req)
        except ProxyError as e:
            self._count_error(e, sess)
            raise
        except web.HTTPException as e:
            if e.status >= 400:
                self.counters["errors_4xx"] += 1
            raise
        self.counters["answered"] += 1
        if req.stream:
            resp = await self._stream(request, req, turn, sess)
        else:
            resp = web.Response(body=dumpb(self._completion(req, turn, sess)), content_type="application/json", charset="utf-8")
        self._account(turn, t_body, c_body)
        return resp

    def _count_error(self, e: ProxyError, sess: Session | None) -> None:
        if e.status >= 500:
            self.counters["errors_5xx"] += 1
        else:
            self.counters["errors_4xx"] += 1
            if sess is not None and e.status == 400 and e.code not in ("session_ended", "context_length_exceeded"):
                sess.counters["bad_requests"] += 1

    def _account(self, turn: TurnResult, t_body: float, c_body: float) -> None:
        self.overheads_s.append(time.perf_counter() - t_body - turn.engine_s)
        self.overhead_cpu_s.append(time.thread_time() - c_body - turn.engine_cpu_s)
        self.encode_times_s.append(turn.encode_s)

    # ------------------------------------------------------------------ answer formats
    @staticmethod
    def _usage(turn: TurnResult) -> dict[str, Any]:
        p, c = len(turn.prompt_ids), len(turn.completion_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}

    @staticmethod
    def _logprobs(turn: TurnResult) -> dict[str, Any] | None:
        if turn.token_texts is None:
            return None
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(turn.token_texts, turn.log_probs)
            ]
        }

    def _completion(self, req: Any, turn: TurnResult, sess: Session) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "message": turn.message,
            "finish_reason": turn.finish_reason,
            "logprobs": self._logprobs(turn),
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{random_hex(32)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": [choice],
            "usage": self._usage(turn),
        }
        if req.return_token_ids:
            choice["token_ids"] = turn.completion_ids
            out["prompt_token_ids"] = turn.prompt_ids
        return out

    @staticmethod
    def _sse_chunker(cid: str, created: int, model: str) -> Any:
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": extra.pop("logprobs", None)}
            if "token_ids" in extra:
                c["token_ids"] = extra.pop("token_ids")
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c], **extra}
            return b"data: " + dumpb(obj) + b"\n\n"

        return chunk

    def _pieces(self, text: str) -> list[str]:
        step = self.config.stream_chunk_chars
        return [text[i : i + step] for i in range(0, len(text), step)]

    def _tail_parts(self, req: Any, turn: TurnResult, chunk: Any, cid: str, created: int, content: str, extras: dict[str, Any]) -> list[bytes]:
        """The stream from the content still to send on: ``content`` in pieces, the tool calls,
        the final chunk, the usage chunk, ``[DONE]``. ``extras`` (log-probs, token ids, …) go on
        the first of these chunks."""
        parts = []
        pieces = self._pieces(content)
        pending = dict(extras)
        for piece in pieces:
            parts.append(chunk({"content": piece}, **pending))
            pending = {}
        for i, call in enumerate(turn.message.get("tool_calls") or ()):
            parts.append(chunk({"tool_calls": [{"index": i, **call}]}, **pending))
            pending = {}
        parts.append(chunk({}, turn.finish_reason, **pending))
        if req.include_usage:
            usage = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.config.model_name, "choices": [], "usage": self._usage(turn)}
            parts.append(b"data: " + dumpb(usage) + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
        return parts

    @staticmethod
    def _prompt_extra(req: Any, prompt_ids: list[int]) -> dict[str, Any]:
        return {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}

    def _answer_extras(self, req: Any, turn: TurnResult) -> dict[str, Any]:
        extras: dict[str, Any] = {"logprobs": self._logprobs(turn)}
        if req.return_token_ids:
            extras["token_ids"] = turn.completion_ids
        return extras

    async def _stream(self, request: web.Request, req: Any, turn: TurnResult, sess: Session) -> web.StreamResponse:
        """The whole stream at once, from a finished answer."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"chatcmpl-{random_hex(32)}", int(time.time())
        chunk = self._sse_chunker(cid, created, self.config.model_name)
        parts = [chunk({"role": "assistant", "content": ""}, **self._prompt_extra(req, turn.prompt_ids))]
        parts += self._tail_parts(req, turn, chunk, cid, created, turn.message.get("content") or "", self._answer_extras(req, turn))
        await resp.write(b"".join(parts))
        await resp.write_eof()
        return resp

    async def _stream_live(self, request: web.Request, req: Any, sess: Session, t_body: float, c_body: float) -> web.StreamResponse:
        """Stream while the engine generates. Errors before the first token are HTTP errors
        (raised); after it, an ``error`` event ends the stream."""
        ct = self.chat_tokenizer
        decoder = IncrementalDecoder(ct.decode, frozenset(ct.stop_token_ids))
        parser = None if req.tool_choice == "none" else self.parser
        arrived: list[int] = []
        wake = asyncio.Event()
        prompt: list[list[int]] = []

        def on_tokens(delta: TokenOutput) -> None:
            arrived.extend(delta.token_ids)
            wake.set()

        task = asyncio.ensure_future(sess.chat(req, on_tokens=on_tokens, on_prompt=prompt.append))
        resp: web.StreamResponse | None = None
        cid, created = f"chatcmpl-{random_hex(32)}", int(time.time())
        chunk = self._sse_chunker(cid, created, self.config.model_name)
        sent = 0  # characters of content sent
        gone = False  # the agent closed the connection: stop writing, still finish (and record) the turn

        async def write(data: bytes) -> None:
            nonlocal gone
            if gone:
                return
            try:
                await resp.write(data)  # type: ignore[union-attr]
            except ConnectionError:
                gone = True

        try:
            while True:
                if not arrived and not task.done():
                    waiter = asyncio.ensure_future(wake.wait())
                    try:
                        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                wake.clear()
                if task.done():
                    break  # the rest comes from the finished answer
                ids = arrived[:]
                arrived.clear()
                decoder.feed(ids)
                limit = content_limit(decoder.text, parser, req.stop)
                parts = []
                if resp is None:
                    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                    await resp.prepare(request)
                    self.counters["live_streams"] += 1
                    parts.append(chunk({"role": "assistant", "content": ""}, **self._prompt_extra(req, prompt[0])))
                if limit > sent:
                    parts += [chunk({"content": p}) for p in self._pieces(decoder.text[sent:limit])]
                    sent = limit
                if parts:
                    await write(b"".join(parts))
        except BaseException:
            task.cancel()  # the handler itself was cancelled or failed: the turn is not recorded
            raise
        try:
            turn = task.result()
        except Exception as e:
            if resp is None:
                raise  # an HTTP error as usual (counted by the handler)
            if isinstance(e, ProxyError):
                self._count_error(e, sess)
                body = e.body()
            else:
                log.exception("proxy: unhandled error in a live stream of session %s", sess.request_id)
                self.counters["errors_5xx"] += 1
                body = {"error": {"message": "internal proxy error", "type": "server_error", "param": None, "code": None}}
            self.counters["stream_errors"] += 1
            await write(b"data: " + dumpb(body) + b"\n\ndata: [DONE]\n\n")
            if not gone:
                await resp.write_eof()
            return resp
        self.counters["answered"] += 1
        content = turn.message.get("content") or ""
        streamed = decoder.text[:sent]
        if not content.startswith(streamed):  # pragma: no cover - a tokenizer whose decoding is not prefix-stable
            self.counters["stream_mismatches"] += 1
            log.warning("proxy: session %s: streamed content %r is not a prefix of the answer's content", sess.request_id, streamed[-40:])
        extras = self._answer_extras(req, turn)
        parts = []
        if resp is None:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            parts.append(chunk({"role": "assistant", "content": ""}, **self._prompt_extra(req, turn.prompt_ids)))
        parts += self._tail_parts(req, turn, chunk, cid, created, content[len(streamed) :] if content.startswith(streamed) else "", extras)
        await write(b"".join(parts))
        if not gone:
            await resp.write_eof()
        self._account(turn, t_body, c_body)
        return resp
