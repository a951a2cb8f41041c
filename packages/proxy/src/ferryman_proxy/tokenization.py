"""Token-in, token-out: the token ids of a conversation built one turn at a time.

The invariant (checked by the property tests for both templates shipped here): for a chat
template with the prefix property, the ids built incrementally — the first prompt tokenized
whole, then for every later turn only the new messages, appended after the model's own tokens —
equal ``tokenizer.apply_chat_template(whole conversation)`` token for token.

How a later turn is tokenized (:meth:`ChatTokenizer.delta_ids`):

1. **Render only a window.** The new messages are rendered after a *context window* — the
   system message (if the conversation has one) and the previous message, the model's last
   answer — once without and once with them (plus the generation prompt). The text the new
   messages add is the difference. Cost is the size of the window and the new messages, not of
   the conversation. If the difference is not a clean suffix, a placeholder answer is tried as
   the previous message; if that fails too, the template is not incremental at this point and
   :class:`NotIncremental` is raised (the session then starts a new segment from a full render).
2. **Tokenize at a hard boundary.** The model stops on the template's end-of-turn token
   (``<|im_end|>``), which is an added token: tokenizers split on added tokens before anything
   else, so the text after it tokenizes independently of what came before. The new text is
   therefore tokenized as ``end_of_turn + tail + delta`` (the tail is what the template writes
   after the end-of-turn token, e.g. ``"\\n"``), and the leading end-of-turn id is dropped when
   the model produced it (or kept, mask 0, when generation stopped without it).
3. **EOS tail backfill.** The tail (and the end-of-turn token when missing) is appended right
   after every generation (mask 0), so a trajectory is complete at any time; the next turn
   replaces those pending tokens by the in-context tokenization of tail + delta (identical for
   the templates here, but this way a tail that merges with the next text is still exact). The
   end-of-turn token and the tail are found once per template, by rendering a probe conversation.

At construction, :meth:`ChatTokenizer.check_incremental` replays a few probe conversations
(system or not, tools, parallel tool calls, consecutive tool results) through this path and
compares with full renders; ``incremental`` is False (with ``probe_error``) when they differ, and
the session then re-tokenizes every turn in full and checks it extends the trajectory.
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["ChatTokenizer", "NotIncremental"]


class NotIncremental(Exception):
    """The template does not render the new messages as a suffix of the context."""


_PLACEHOLDER = "ferryman placeholder answer"
_PLACEHOLDER_ANSWER: dict[str, Any] = {"role": "assistant", "content": _PLACEHOLDER}


_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _without_unicode_normalizer(backend: Any) -> Any:
    """``encode_batch_fast`` of a copy of ``backend`` without its normalizer, or None when the
    normalizer does anything besides Unicode normalisation (which is the identity on ASCII)."""
    if backend is None or getattr(backend, "encode_batch_fast", None) is None:
        return None
    try:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str()).get("normalizer")
        if spec is None:
            return None
        parts = spec.get("normalizers", []) if spec.get("type") == "Sequence" else [spec]
        if not all(isinstance(p, dict) and p.get("type") in _UNICODE_FORMS for p in parts):
            return None
        copy = Tokenizer.from_str(backend.to_str())
        copy.normalizer = None
        probe = "ferryman probe: <tool_call>\n{\"a\": [1, 2.5]}\n</tool_call>\tTabs  and   spaces\r\n~`!@#$%^&*()_+-=|;:',.<>/?"
        for tok in list(getattr(backend, "get_added_tokens_decoder", dict)().values())[:8]:
            probe += f" {tok.content} x{tok.content}y"
        if copy.encode(probe, add_special_tokens=False).ids != backend.encode(probe, add_special_tokens=False).ids:
            return None
        return copy.encode_batch_fast
    except Exception:  # noqa: BLE001 - an optimisation only
        return None


def _with_memoised_sandbox_checks(compiled: Any, template: str) -> Any:
    """The template compiled again in a copy of its sandboxed environment whose attribute check
    is memoised per (type, attribute name).

    Jinja's sandbox decides whether a template may read ``obj.attr`` from ``type(obj)`` and the
    name alone (``SandboxedEnvironment``: no ``_`` prefix, not an internal attribute of functions,
    frames, …; ``ImmutableSandboxedEnvironment``: nor a mutating method of a list, dict or set),
    and repeats that decision, a dozen ``isinstance`` checks, at every ``loop.first`` of every
    render. The same decisions are kept, each made once. Only for those two environment classes
    (another class may decide from the value); otherwise ``compiled`` is returned as is."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

        env = compiled.environment
        base = type(env)
        if base not in (ImmutableSandboxedEnvironment, SandboxedEnvironment):
            return compiled
        check = base.is_safe_attribute
        cache: dict[tuple[type, str], bool] = {}

        def is_safe_attribute(self: Any, obj: Any, attr: str, value: Any) -> bool:
            key = (type(obj), attr)
            ok = cache.get(key)
            if ok is None:
                ok = cache[key] = bool(check(self, obj, attr, value))
            return ok

        memo = type(f"Memoised{base.__name__}", (base,), {"is_safe_attribute": is_safe_attribute})
        copy = env.overlay()
        copy.__class__ = memo
        return copy.from_string(template)
    except Exception:  # noqa: BLE001 - an optimisation only
        return compiled


class ChatTokenizer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template or not isinstance(template, str):
            raise ValueError("ChatTokenizer: the tokenizer has no chat template (set ProxyConfig.chat_template)")
        self.template = template
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._encode_fast = getattr(backend, "encode_batch_fast", None)
        """``tokenizers``' batch encoding without character offsets (which the proxy never reads):
        the same ids, about a fifth less CPU than ``encode``; run on the calling thread for a
        batch of one."""
        self._encode_ascii = _without_unicode_normalizer(backend)
        """For ASCII text: the same tokenizer less its normalizer, when that normalizer is only
        Unicode normal forms (NFC/NFD/NFKC/NFKD leave ASCII unchanged); checked on the probes."""
        self.encode_s = 0.0
        """CPU time spent in the tokenizer's ``encode`` (all calls; for benchmarks)."""
        added = [str(t) for t in getattr(tokenizer, "added_tokens_encoder", {})]
        self._added_by_length = sorted(added, key=len, reverse=True)
        self._compiled: Any = None
        self._template_kwargs = {k: (v if isinstance(v, (str, list)) else str(v)) for k, v in tokenizer.special_tokens_map.items()}
        self._find_turn_end()
        self.stop_token_ids = sorted({self.turn_end_id} | ({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()))
        self.incremental = True
        self.light_window = False
        """Render the new messages after the previous answer alone, without the system message
        and without tools (cheaper), when the self-check shows the template allows it."""
        self.placeholder_window = False
        """Light window, with a fixed placeholder answer in place of the previous answer: the
        context's render is then the same every turn and is cached (one render per turn)."""
        self._placeholder_text: str | None = None
        self.probe_error: str | None = None
        try:
            self.check_incremental()
        except AssertionError as e:
            self.incremental = False
            self.probe_error = str(e)
        if self.incremental:
            self._try_fast_paths()

    # ------------------------------------------------------------------ basics
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
        """The template's text for normalised messages (plain JSON values, no ``None`` fields).

        Through transformers' ``apply_chat_template``, or — once the self-check has shown that
        both agree — straight through the compiled template, which skips transformers' per-call
        copying of the messages and tools."""
        if self._compiled is not None:
            return self._compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._template_kwargs
            )
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _try_fast_paths(self) -> None:
        """Switch on the cheaper paths that the probes show to give identical ids: the direct
        render, then the light window, then the placeholder window."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.template)
        except Exception:  # noqa: BLE001 - a private API: without it, the public path is used
            compiled = None
        if compiled is not None:
            compiled = _with_memoised_sandbox_checks(compiled, self.template)
        if compiled is not None:
            slow = [self.render(m, t, g) for m, t in self._probes() for g in (False, True)]
            self._compiled = compiled
            try:
                fast = [self.render(m, t, g) for m, t in self._probes() for g in (False, True)]
                assert fast == slow
                self.check_incremental()
            except Exception:  # noqa: BLE001
                self._compiled = None
        for flag in ("light_window", "placeholder_window"):
            setattr(self, flag, True)
            try:
                self.check_incremental()
            except AssertionError:
                setattr(self, flag, False)
                break

    def encode(self, text: str) -> list[int]:
        t0 = time.thread_time()
        if self._encode_ascii is not None and text.isascii():
            ids = self._encode_ascii([text], add_special_tokens=False)[0].ids
        elif self._encode_fast is not None:
            ids = self._encode_fast([text], add_special_tokens=False)[0].ids
        elif self._backend is not None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        self.encode_s += time.thread_time() - t0
        return ids

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return self._backend.decode(ids, skip_special_tokens=True)  # what transformers does, less its wrapping
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def full_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> list[int]:
        """Render and tokenize the whole conversation (the first turn, and the reference)."""
        return self.encode(self.render(messages, tools, add_generation_prompt))

    # ------------------------------------------------------------------ template facts, found once
    def _find_turn_end(self) -> None:
        """The end-of-turn token the template writes after an answer and the tail after it."""
        msgs = [{"role": "user", "content": "ferryman probe question"}, {"role": "assistant", "content": _PLACEHOLDER}]
        text = self.render(msgs, None, False)
        at = text.rfind(_PLACEHOLDER)
        if at < 0:
            raise ValueError("ChatTokenizer: the chat template does not render an assistant message's content")
        suffix = text[at + len(_PLACEHOLDER) :]
        for tok in self._added_by_length:
            if tok and suffix.startswith(tok):
                self.turn_end_text = tok
                break
        else:
            raise ValueError(
                "ChatTokenizer: the chat template does not close an assistant turn with an added token "
                f"(it writes {suffix!r} after the content); token-exact tokenization needs one"
            )
        self.turn_end_id = int(self.tokenizer.convert_tokens_to_ids(self.turn_end_text))
        self.tail_text = suffix[len(self.turn_end_text) :]
        ids = self.encode(self.turn_end_text + self.tail_text)
        if not ids or ids[0] != self.turn_end_id:
            raise ValueError(f"ChatTokenizer: {self.turn_end_text!r} does not tokenize to a single token")
        self.tail_ids = ids[1:]
        """The template's tail after the end-of-turn token, as tokens (``"\\n"`` for ChatML)."""

    def starts_with_added_token(self, text: str) -> bool:
        return any(text.startswith(t) for t in self._added_by_length if t)

    # ------------------------------------------------------------------ the incremental step
    def delta_ids(
        self,
        head: list[dict[str, Any]],
        prev: dict[str, Any],
        delta: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        """Ids of ``end_of_turn + tail + render(delta) + generation prompt`` in context.

        ``head`` is the conversation's system message (or empty), ``prev`` the last message
        already in the trajectory (the model's answer). The first id is always ``turn_end_id``.
        """
        text = self._delta_text(head, prev, delta, tools)
        ids = self.encode(self.turn_end_text + self.tail_text + text)
        if not ids or ids[0] != self.turn_end_id:  # pragma: no cover - guarded by _find_turn_end
            raise NotIncremental("the end-of-turn token did not tokenize alone")
        return ids

    def _delta_text(self, head, prev, delta, tools) -> str:
        closing = self.turn_end_text + self.tail_text
        if self.placeholder_window:
            if self._placeholder_text is None:
                self._placeholder_text = self.render([_PLACEHOLDER_ANSWER], None, False)
            a = self._placeholder_text
            b = self.render([_PLACEHOLDER_ANSWER, *delta], None, True)
            if b.startswith(a) and a.endswith(closing):
                return b[len(a) :]
        candidates = [prev]
        if prev != _PLACEHOLDER_ANSWER:
            candidates.append(_PLACEHOLDER_ANSWER)
        if self.light_window:
            head, tools = [], None
        for p in candidates:
            base = [*head, p]
            a = self.render(base, tools, False)
            b = self.render(base + delta, tools, True)
            if b.startswith(a) and a.endswith(closing):
                return b[len(a) :]
        raise NotIncremental("rendering the new messages does not extend the rendered context")

    # ------------------------------------------------------------------ self-check
    def check_incremental(self) -> None:
        """Replay probe conversations incrementally and compare with full renders (AssertionError)."""
        for messages, tls in self._probes():
            ids = self.replay(messages, tls)
            full = self.full_ids(messages, tls, False)
            assert ids == full, (
                f"incremental ids differ from the full render at token {next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))}"
                f" for probe {json.dumps(messages)[:200]}"
            )

    @staticmethod
    def _probes() -> list[tuple[list[dict[str, Any]], Any]]:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "probe_tool",
                    "description": "A probe.",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}}},
                },
            }
        ]

        def call(x: int) -> dict[str, Any]:
            return {"id": f"c{x}", "type": "function", "function": {"name": "probe_tool", "arguments": {"x": x, "s": "a b"}}}

        convs: list[tuple[list[dict[str, Any]], Any]] = [
            (
                [
                    {"role": "system", "content": "Probe system."},
                    {"role": "user", "content": "First question?"},
                    {"role": "assistant", "content": "First answer."},
                    {"role": "user", "content": "Second question?"},
                    {"role": "assistant", "content": "Calling.", "tool_calls": [call(1), call(2)]},
                    {"role": "tool", "tool_call_id": "c1", "content": "one"},
                    {"role": "tool", "tool_call_id": "c2", "content": "two"},
                    {"role": "assistant", "content": "", "tool_calls": [call(3)]},
                    {"role": "tool", "tool_call_id": "c3", "content": "three"},
                    {"role": "user", "content": "Thanks."},
                    {"role": "assistant", "content": "Done."},
                ],
                tools,
            ),
            (
                [
                    {"role": "user", "content": "Question?"},
                    {"role": "assistant", "content": "", "tool_calls": [call(4)]},
                    {"role": "tool", "tool_call_id": "c4", "content": "four"},
                    {"role": "assistant", "content": "Answer."},
                ],
                tools,
            ),
            (
                [
                    {"role": "user", "content": "Hello."},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "user", "content": "Bye."},
                    {"role": "assistant", "content": "Bye."},
                ],
                None,
            ),
        ]
        return convs

    def replay(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Build a conversation's ids the proxy's way, with each answer's tokens taken from the
        full render (a model that writes exactly what the template would)."""
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert answers, "probe needs an assistant message"
        ids = self.full_ids(messages[: answers[0]], tools, True)
        head = messages[:1] if messages[0]["role"] == "system" else []
        prev_end = 0
        for k, j in enumerate(answers):
            if k:
                delta = messages[prev_end + 1 : j]
                d = self.delta_ids(head, messages[prev_end], delta, tools)
                ids = ids[: -len(self.tail_ids) or None] if self.tail_ids else ids
                ids += d[1:]
            full = self.full_ids(messages[: j + 1], tools, False)
            assert full[: len(ids)] == ids, "the prompt of a later turn is not a prefix of the full render"
            end = len(full) - len(self.tail_ids)
            assert full[end - 1] == self.turn_end_id, "the full render does not end an answer with the end-of-turn token"
            ids = full[:end] + list(self.tail_ids)
            prev_end = j
        return ids
