"""``dataset``: an env made of a data file and a reward function, single- or multi-turn.

    env:
      type: dataset
      path: data/train.jsonl            # or .parquet (extra ``parquet``: pyarrow)
      prompt_key: question              # a string (the user message) or a list of chat messages
      answer_key: answer                # anything JSON: handed to the reward function
      reward: ferryman_proxy.dataset_examples:first_number_reward   # module:function
      tools: [ferryman_proxy.dataset_examples:calculator]           # optional: Python tools
      max_turns: 4

Every row becomes one task. The agent loop is white-box and runs in the Rollouter's process: each
turn goes through a proxy :class:`~ferryman_proxy.session.Session` (no HTTP), so the chat
template, the incremental token-exact tokenization and the tool-call parser are the proxy's own
and a white-box run tokenizes exactly as a black-box agent behind the proxy would. When an
answer has tool calls, each named tool (a plain Python function; ``async def`` is awaited) is
called with the parsed arguments, its result (``str()`` of it, or the error) goes back as a
``tool`` message, and the next turn starts; an answer without tool calls, ``max_turns``, or a
proxy limit ends the run. The reward function is then called with the final answer's text and
the row's answer:

    def reward(completion: str, answer, *, row: dict, messages: list[dict]) -> float | dict

(``row`` and ``messages`` are passed only if it takes them; a dict carries ``reward`` plus
numbers that go to the trackers as ``dataset/<key>``). Tools must be functions of their
arguments (no hidden state): then a run is a function of the task and the model's outputs, and a
run cut by a checkpoint resumes by replay (``resumable``).

Rows are checked when the config is validated: a bad row fails with the file, the line (jsonl)
or row number (parquet) and the field.
"""

from __future__ import annotations

import inspect
import json
import os
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ferryman.config import PluginConfig
from ferryman.protocols import GenerateClient
from ferryman.types import SamplingParams, Trajectory

from ferryman_proxy.config import ProxyConfig
from ferryman_proxy.env import _check_import_path, import_object
from ferryman_proxy.errors import ProxyError

__all__ = ["DatasetEnv", "DatasetEnvConfig", "DatasetError", "load_rows", "tool_schema"]

_ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A data file that cannot be used, naming the file, the line and the field."""


class DatasetEnvConfig(PluginConfig):
    type: Literal["dataset"] = "dataset"
    path: str
    """A ``.jsonl`` file (one JSON object per line) or a ``.parquet`` file."""
    prompt_key: str = "prompt"
    """The field holding the prompt: a string (sent as the user message) or a list of chat
    messages (``{"role", "content"}``)."""
    answer_key: str = "answer"
    """The field holding the reference answer (any JSON value), given to ``reward``."""
    reward: str = "ferryman_proxy.dataset_examples:exact_match_reward"
    """Import path ``package.module:function`` of the reward function."""
    system_prompt: str | None = None
    """A system message put before string prompts."""
    tools: list[str] = Field(default_factory=list)
    """Import paths of Python functions offered to the model as tools (their signature and
    docstring make the schema; parameters annotated ``int``, ``float``, ``str``, ``bool``)."""
    max_turns: int = Field(1, ge=1)
    """Model calls per run (with tools: at most this many turns)."""
    limit: int | None = Field(None, ge=1)
    """Use only the first ``limit`` rows."""
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    """Chat template and tool-call parser (``tool_parser``), and the session limits
    (``max_total_tokens``) — the proxy's own settings."""

    @field_validator("reward")
    @classmethod
    def _reward_path(cls, v: str) -> str:
        return _check_import_path(v)

    @field_validator("tools")
    @classmethod
    def _tool_paths(cls, v: list[str]) -> list[str]:
        return [_check_import_path(p) for p in v]

    @model_validator(mode="after")
    def _rows_are_good(self) -> DatasetEnvConfig:
        # every row is read and checked here, so a bad file fails before anything starts
        rows = load_rows(self.path, self.prompt_key, self.answer_key)
        if not rows:
            raise ValueError(f"path: {self.path}: no rows")
        import_object(self.reward, "reward")
        for i, p in enumerate(self.tools):
            tool_schema(import_object(p, f"tools.{i}"), f"tools.{i}")
        return self


# --------------------------------------------------------------------------- rows


def _check_row(row: Any, where: str, prompt_key: str, answer_key: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise DatasetError(f"{where}: field {prompt_key!r} (prompt_key): missing (fields: {sorted(row)})")
    if answer_key not in row:
        raise DatasetError(f"{where}: field {answer_key!r} (answer_key): missing (fields: {sorted(row)})")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: field {prompt_key!r}: empty prompt")
    elif isinstance(prompt, list) and prompt:
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise DatasetError(
                    f"{where}: field {prompt_key!r}[{j}]: a chat message needs a role ({', '.join(_ROLES)}) and a string content"
                )
    else:
        raise DatasetError(f"{where}: field {prompt_key!r}: must be a string or a non-empty list of chat messages, got {type(prompt).__name__}")
    return row


def _read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            rows.append(_check_row(row, where, prompt_key, answer_key))
    return rows


def _read_parquet(path: Path, prompt_key: str, answer_key: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install 'ferryman-proxy[parquet]')") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in table.column_names:
            raise DatasetError(f"{path}: field {key!r} ({what}): no such column (columns: {table.column_names})")
    return [_check_row(row, f"{path}: row {i}", prompt_key, answer_key) for i, row in enumerate(table.to_pylist())]


def load_rows(path: str | os.PathLike[str], prompt_key: str, answer_key: str) -> list[dict[str, Any]]:
    """Every row of a ``.jsonl`` or ``.parquet`` file, checked (:class:`DatasetError` names the
    file, line or row, and field of the first bad one). Cached per file state."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: no such file")
    st = p.stat()
    return list(_load_rows_cached(str(p.resolve()), st.st_mtime_ns, st.st_size, prompt_key, answer_key))


@lru_cache(maxsize=8)
def _load_rows_cached(path: str, _mtime: int, _size: int, prompt_key: str, answer_key: str) -> tuple[dict[str, Any], ...]:
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return tuple(_read_jsonl(p, prompt_key, answer_key))
    if suffix in (".parquet", ".pq"):
        return tuple(_read_parquet(p, prompt_key, answer_key))
    raise DatasetError(f"{p}: unknown data file type {suffix!r} (allowed: .jsonl, .parquet)")


# --------------------------------------------------------------------------- tools

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def tool_schema(fn: Any, field: str = "tool") -> dict[str, Any]:
    """The OpenAI tool schema of a Python function: name, first docstring paragraph, and one
    parameter per argument (``int``/``float``/``str``/``bool`` annotations; others: no type)."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise ValueError(f"{field}: cannot read the signature of {fn!r}: {e}") from None
    props: dict[str, Any] = {}
    required = []
    for name, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        ann = hints.get(name)
        props[name] = {"type": _JSON_TYPES[ann]} if ann in _JSON_TYPES else {}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


async def _call_tool(fn: Any, arguments: Any) -> str:
    try:
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
        result = fn(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result if isinstance(result, str) else json.dumps(result) if isinstance(result, (dict, list)) else str(result)
    except Exception as e:  # noqa: BLE001 - the model sees the error, as from any tool
        return f"error: {e.__class__.__name__}: {e}"


# --------------------------------------------------------------------------- the env


class DatasetEnv:
    resumable = True
    """A run is a function of its row and the model's outputs (tools must be pure functions)."""

    def __init__(self, config: DatasetEnvConfig, tokenizer: Any, seed: int = 0) -> None:
        from ferryman_proxy.parsers import get_parser
        from ferryman_proxy.templates import resolve_template
        from ferryman_proxy.tokenization import ChatTokenizer

        self.config = config
        self.tokenizer = tokenizer
        rows = load_rows(config.path, config.prompt_key, config.answer_key)
        self._rows = rows[: config.limit] if config.limit else rows
        self._reward = import_object(config.reward, "env.reward")
        params = inspect.signature(self._reward).parameters
        self._reward_kwargs = {k for k in ("row", "messages") if k in params or any(p.kind is p.VAR_KEYWORD for p in params.values())}
        self._tools = {}
        for i, path in enumerate(config.tools):
            fn = import_object(path, f"env.tools.{i}")
            self._tools[fn.__name__] = fn
        self._schemas = [tool_schema(fn) for fn in self._tools.values()] or None
        self._ct = ChatTokenizer(tokenizer, resolve_template(config.proxy.chat_template))
        self._parser = get_parser(config.proxy.tool_parser)
        self.counters = {"runs": 0, "turns": 0, "tool_calls": 0, "tool_errors": 0, "unknown_tools": 0}

    @classmethod
    def from_config(cls, config: DatasetEnvConfig, *, tokenizer: Any, seed: int = 0, **_: Any) -> DatasetEnv:
        return cls(config, tokenizer, seed)

    def num_tasks(self) -> int:
        return len(self._rows)

    def get_task(self, index: int) -> dict[str, Any]:
        return {"index": index, "row": self._rows[index]}

    def stats(self) -> dict[str, float]:
        return {f"dataset/{k}": float(v) for k, v in self.counters.items()}

    def _first_messages(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = row[self.config.prompt_key]
        if isinstance(prompt, list):
            return [dict(m) for m in prompt]
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return [*messages, {"role": "user", "content": prompt}]

    async def run(self, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams) -> list[Trajectory]:
        from ferryman_proxy.messages import parse_chat_request
        from ferryman_proxy.session import Session

        cfg = self.config
        row = task["row"]
        sess = Session(
            secret="in-process", request_id=request_id, params=params, base_url="in-process", model_name=cfg.proxy.model_name,
            client=client, chat_tokenizer=self._ct, parser=self._parser, config=cfg.proxy,
        )
        messages = self._first_messages(row)
        answer_text = ""
        turns = tool_calls = 0
        self.counters["runs"] += 1
        for _ in range(cfg.max_turns):
            body: dict[str, Any] = {"model": cfg.proxy.model_name, "messages": messages}
            if self._schemas:
                body["tools"] = self._schemas
            try:
                turn = await sess.chat(parse_chat_request(body, cfg.proxy.model_name, sess.known))
            except ProxyError as e:
                if e.status >= 500 or not sess.end_reason:
                    raise
                break  # a session limit (context length, max_turns): score what there is
            turns += 1
            msg = turn.message
            messages.append(msg)
            answer_text = msg.get("content") or ""
            calls = msg.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                name = call["function"]["name"]
                fn = self._tools.get(name)
                tool_calls += 1
                if fn is None:
                    self.counters["unknown_tools"] += 1
                    result = f"error: no tool named {name!r}"
                else:
                    try:
                        args = json.loads(call["function"]["arguments"])
                    except json.JSONDecodeError as e:
                        args = e
                    result = await _call_tool(fn, args) if not isinstance(args, Exception) else f"error: arguments are not JSON ({args})"
                if result.startswith("error:"):
                    self.counters["tool_errors"] += 1
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        self.counters["turns"] += turns
        self.counters["tool_calls"] += tool_calls
        result = sess.result()
        if not result.trajectories:
            raise RuntimeError(f"dataset run {request_id}: no model call succeeded (end_reason={result.end_reason})")
        kwargs = {"row": row, "messages": messages}
        outcome = self._reward(answer_text, row[cfg.answer_key], **{k: kwargs[k] for k in self._reward_kwargs})
        if inspect.isawaitable(outcome):
            outcome = await outcome
        extra: dict[str, float] = {}
        if isinstance(outcome, dict):
            reward = outcome.get("reward")
            extra = {f"dataset/{k}": float(v) for k, v in outcome.items() if k != "reward" and isinstance(v, (int, float))}
        else:
            reward = outcome
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"reward {cfg.reward} returned {outcome!r}; expected a number or a dict with 'reward'")
        for t in result.trajectories:
            t.reward = float(reward)
            t.metrics.update(extra)
            t.metrics["dataset/turns"] = float(turns)
            t.metrics["dataset/tool_calls"] = float(tool_calls)
            t.extra["end_reason"] = result.end_reason
            t.extra["completion"] = answer_text
        return result.trajectories
