"""A tiny Qwen-style model built locally: tokenizer, chat template, random weights.

:func:`build_tiny_model` writes an ordinary transformers directory (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``) that ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` load. Nothing is downloaded: the byte-level BPE
tokenizer is trained on :func:`tiny_corpus` and the weights are random (seeded).

The tokenizer:

* uses the pipeline of transformers' ``Qwen2Tokenizer`` (NFC, Qwen's split pattern,
  byte-level BPE), which is what ``AutoTokenizer`` rebuilds for a ``qwen2`` model anyway;
* covers printable ASCII plus tab, newline and carriage return only: the vocabulary is too
  small for all 256 bytes, so other characters have no token and are dropped when encoding;
* splits every digit into its own pre-token, so ``0``..``9`` are always single tokens;
* has the ChatML specials ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1) and
  ``<|im_end|>`` (eos, 2), and the tags ``<tool_call>``, ``</tool_call>``,
  ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` as (non-special) added
  tokens at the end of the vocabulary, as in Qwen2.5: ``decode(..., skip_special_tokens=True)``
  keeps the tags so tool calls can be parsed from decoded text.

The chat template (:data:`CHAT_TEMPLATE`) is Qwen2.5-style ChatML with tools. It has the
*prefix property*: rendering ``messages[:k]`` is a prefix of rendering ``messages[:k+1]``, and
rendering ``messages[:k]`` with ``add_generation_prompt=True`` is a prefix of rendering
``messages[:k+1]`` when ``messages[k]`` is an assistant message. To get both with consecutive
``tool`` messages sharing one user turn, the user turn holding tool responses is closed
(``<|im_end|>``) by the message that follows it or by the generation prompt, not by the last
tool message itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "SHAPE_PRESETS",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "ShapePreset",
    "build_tiny_model",
    "min_vocab_size",
    "tiny_corpus",
]

MARKER_FILE = "ferryman_tiny.json"
_FORMAT = 1
"""Bump when the build recipe changes, so old directories are rebuilt."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens (``special=True``), ids 0, 1, 2."""
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Markup tokens (``special=False``, like Qwen2.5), the last ids of the vocabulary."""

_ALLOWED_BYTES = [9, 10, 13, *range(0x20, 0x7F)]

DEFAULT_SYSTEM = "You are a helpful assistant."

# The template is written without literal newlines between Jinja tags; every newline that
# reaches the output is an explicit "\n" inside a string literal.
CHAT_TEMPLATE = "".join(
    [
        "{%- macro text(content) -%}",
        "{%- if content is none -%}",
        "{%- elif content is string -%}{{- content -}}",
        "{%- else -%}{%- for part in content -%}",
        "{%- if part is string -%}{{- part -}}",
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}",
        "{%- endfor -%}{%- endif -%}",
        "{%- endmacro -%}",
        "{%- set ns = namespace(first=0) -%}",
        "{%- if tools -%}",
        "{%- if messages and messages[0]['role'] == 'system' -%}",
        "{%- set system = text(messages[0]['content']) -%}{%- set ns.first = 1 -%}",
        "{%- else -%}{%- set system = '" + DEFAULT_SYSTEM + "' -%}{%- endif -%}",
        "{{- '<|im_start|>system\\n' + system + '\\n\\n# Tools\\n\\nFunctions you may call:\\n<tools>' -}}",
        "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}",
        "{{- '\\n</tools>\\n\\nTo call one, answer with:\\n<tool_call>\\n"
        '{"name": <name>, "arguments": <json>}'
        "\\n</tool_call><|im_end|>\\n' -}}",
        "{%- endif -%}",
        "{%- for message in messages[ns.first:] -%}",
        "{%- if message['role'] == 'tool' -%}",
        "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
        "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' -}}",
        "{%- else -%}",
        "{%- if not loop.first and loop.previtem['role'] == 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
        "{%- set content = text(message['content']) -%}",
        "{{- '<|im_start|>' + message['role'] + '\\n' + content -}}",
        "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined "
        "and message['tool_calls'] -%}",
        "{%- for call in message['tool_calls'] -%}",
        "{%- if call['function'] is defined -%}{%- set fn = call['function'] -%}"
        "{%- else -%}{%- set fn = call -%}{%- endif -%}",
        "{%- if not loop.first or content -%}{{- '\\n' -}}{%- endif -%}",
        "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}",
        "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
        "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}",
        "{{- '}\\n</tool_call>' -}}",
        "{%- endfor -%}",
        "{%- endif -%}",
        "{{- '<|im_end|>\\n' -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        "{%- if messages and messages[-1]['role'] == 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
        "{{- '<|im_start|>assistant\\n' -}}",
        "{%- endif -%}",
    ]
)


# ----------------------------------------------------------------------------- shape presets


@dataclass(frozen=True)
class ShapePreset:
    """The architecture numbers of a released model (from its ``config.json``). A model built
    from a preset has exactly these, random weights, and the tiny tokenizer's vocabulary (so
    its embedding and LM-head matrices are ``vocab × hidden`` with a vocabulary of a few hundred,
    not the real ~152k: the real tokenizer cannot be downloaded)."""

    architecture: Literal["qwen2", "qwen3"]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    tie_word_embeddings: bool
    max_positions: int
    head_dim: int | None = None
    """Set where it is not ``hidden_size / num_heads`` (Qwen3)."""
    rms_norm_eps: float = 1e-6
    real_vocab_size: int = 151936
    """The released model's vocabulary (documentation only; the built model has the tiny one)."""


SHAPE_PRESETS: dict[str, ShapePreset] = {
    # Qwen/Qwen2.5-*-Instruct config.json: QKV bias, SwiGLU, RMSNorm, GQA
    "qwen2.5-0.5b": ShapePreset("qwen2", 896, 4864, 24, 14, 2, 1e6, True, 32768),
    "qwen2.5-1.5b": ShapePreset("qwen2", 1536, 8960, 28, 12, 2, 1e6, True, 32768),
    "qwen2.5-3b": ShapePreset("qwen2", 2048, 11008, 36, 16, 2, 1e6, True, 32768),
    "qwen2.5-7b": ShapePreset("qwen2", 3584, 18944, 28, 28, 4, 1e6, False, 32768, real_vocab_size=152064),
    # Qwen/Qwen3-*: no QKV bias, q/k RMSNorm, head_dim 128 whatever the hidden size
    "qwen3-0.6b": ShapePreset("qwen3", 1024, 3072, 28, 16, 8, 1e6, True, 40960, head_dim=128),
    "qwen3-1.7b": ShapePreset("qwen3", 2048, 6144, 28, 16, 8, 1e6, True, 40960, head_dim=128),
}
"""Shapes :func:`build_tiny_model` knows by name (``preset=``, ``ferryman tiny-model --preset``,
``model.tiny_preset``)."""


# ----------------------------------------------------------------------------- corpus

_WORDS = (
    "the a an is are was be to of and in on for with that this it as at by from or not but "
    "what which who when where how why can will would should could do does did have has had "
    "you your we our they their he she his her i me my user assistant system tool function "
    "answer question number digit sum plus minus times divided result value list item name "
    "arguments call calculator search weather city today file code python return print data "
    "model token text reply please thanks sure here there now then next first last repeat "
    "say write count add subtract multiply compute check find open read run test true false "
    "none null yes no ok good right wrong step think reason because so if else"
).split()

_NAMES = ("calculator", "search", "get_weather", "read_file", "python", "lookup")
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi")


def tiny_corpus(extra: list[str] | None = None) -> list[str]:
    """The deterministic training text of the tiny tokenizer (plus ``extra``).

    English-ish sentences, arithmetic questions and answers, the phrases of the ``digits``
    env, tool-call JSON and code-like lines. Tool and ChatML tags are left out: they are added
    tokens, never pieces of BPE merges.
    """
    rng = random.Random(1234)
    lines: list[str] = []
    for d in range(10):
        lines += [
            f"Repeat the digit {d}.",
            f"Say {d}.",
            f"Write the digit {d}.",
            f"Answer with {d}.",
            f"Now the digit {d}.",
            f"The answer is {d}.",
        ]
        lines += [f"What is {d} plus {e}?" for e in range(10)]
    for _ in range(300):
        a, b = rng.randrange(100), rng.randrange(100)
        op, sym, val = rng.choice([("plus", "+", a + b), ("minus", "-", a - b), ("times", "*", a * b)])
        lines += [
            f"What is {a} {op} {b}?",
            f"The answer is {val}.",
            f"{a} {sym} {b} = {val}",
        ]
    for _ in range(200):
        name = rng.choice(_NAMES)
        if name == "calculator":
            args: dict[str, Any] = {"a": rng.randrange(100), "b": rng.randrange(100)}
            if rng.random() < 0.5:
                args["op"] = rng.choice(["add", "sub", "mul"])
        elif name == "get_weather":
            args = {"city": rng.choice(_CITIES)}
        elif name == "read_file":
            args = {"path": f"data/file_{rng.randrange(10)}.txt"}
        else:
            args = {"query": " ".join(rng.choice(_WORDS) for _ in range(3))}
        lines.append(json.dumps({"name": name, "arguments": args}))
        lines.append(json.dumps({"result": rng.randrange(1000)}))
    for _ in range(40):
        fn = rng.choice(["add", "mul", "solve", "parse", "count"])
        x, y = rng.choice("abcxyz"), rng.choice("nmkij")
        lines += [
            f"def {fn}({x}, {y}):\n    return {x} + {y}\n",
            f"for {y} in range({rng.randrange(20)}):\n    print({y})\n",
            f"if {x} == {rng.randrange(10)}:\n\t{x} = [{x}, {y}]\n",
            f'{{"type": "function", "function": {{"name": "{fn}", "description": "Compute {fn}.", '
            f'"parameters": {{"type": "object", "properties": {{"{x}": {{"type": "integer"}}}}}}}}}}',
        ]
    for _ in range(600):
        n = rng.randrange(4, 12)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","]))
    lines += [
        "user\n",
        "assistant\n",
        "system\n",
        DEFAULT_SYSTEM,
        "# Tools\n\nFunctions you may call:\n",
        "To call one, answer with:\n",
        '{"name": <name>, "arguments": <json>}',
        "The quick brown fox jumps over the lazy dog.\r\n",
    ]
    if extra:
        lines += list(extra)
    return lines


def min_vocab_size() -> int:
    """The smallest ``vocab_size`` :func:`build_tiny_model` accepts (alphabet + specials + tags)."""
    return len(_ALLOWED_BYTES) + len(SPECIAL_TOKENS) + len(TAG_TOKENS)


# ----------------------------------------------------------------------------- tokenizer


def _pretokenize_regex() -> str:
    """The split pattern of transformers' ``Qwen2Tokenizer``.

    In transformers 5, ``AutoTokenizer`` loads any ``qwen2`` model's tokenizer as
    ``Qwen2Tokenizer``, which rebuilds the normaliser and pre-tokeniser itself (NFC, this split
    pattern, byte-level). Training with the same pipeline keeps ``tokenizer.json`` and every
    loader in agreement. The pattern isolates each ``\\p{N}`` character, so digits are single
    pre-tokens and therefore single tokens.
    """
    try:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        return str(PRETOKENIZE_REGEX)
    except ImportError:  # pragma: no cover - older/newer layouts
        return r"\p{N}|[^\r\n\p{L}\p{N}]?\p{L}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _train_tokenizer(vocab_size: int, corpus: list[str]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = [byte_level.pre_tokenize_str(chr(b))[0][0] for b in _ALLOWED_BYTES]

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_pretokenize_regex()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def _fast_tokenizer(tok: Any, max_length: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------- model


def _build_args(**kwargs: Any) -> dict[str, Any]:
    extra = kwargs.pop("extra_corpus")
    digest = hashlib.sha256(json.dumps(list(extra or []), ensure_ascii=False).encode()).hexdigest()
    return {"format": _FORMAT, **kwargs, "extra_corpus_sha256": digest}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data.get("args") if isinstance(data, dict) else None


def _preset_config(args: dict[str, Any], n_vocab: int, max_positions: int, ids: dict[str, int]) -> Any:
    """The transformers config of a preset-shaped model (``args["preset"]`` set)."""
    shape = SHAPE_PRESETS[args["preset"]]
    common = dict(
        vocab_size=n_vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=args["num_layers"],
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        use_sliding_window=False,
        initializer_range=args["init_std"],
        **ids,
    )
    if shape.architecture == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=shape.head_dim, attention_bias=False, **common)
    from transformers import Qwen2Config

    return Qwen2Config(**common)


def _write_model(out: Path, args: dict[str, Any], corpus: list[str], max_positions: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _train_tokenizer(args["vocab_size"], corpus)
    fast = _fast_tokenizer(tok, max_positions)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    pad_id = tok.token_to_id("<|endoftext|>")
    eos_id = tok.token_to_id("<|im_end|>")
    ids = dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)

    if args.get("preset"):
        config = _preset_config(args, n_vocab, max_positions, ids)
        dtype = getattr(torch, args.get("dtype", "float32"))
        # on a GPU when there is one: a 7B shape initialises in seconds there, minutes on a CPU
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.random.fork_rng(devices=[0] if device == "cuda" else []):
            torch.manual_seed(args["seed"])
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = model.to("cpu")
        if device == "cuda":  # the building process (a run's driver) keeps no device memory
            torch.cuda.empty_cache()
    else:
        config = Qwen2Config(
            vocab_size=n_vocab,
            hidden_size=args["hidden_size"],
            intermediate_size=2 * args["hidden_size"],
            num_hidden_layers=args["num_layers"],
            num_attention_heads=args["num_heads"],
            num_key_value_heads=args["num_kv_heads"],
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rms_norm_eps=1e-6,
            initializer_range=args["init_std"],
            **ids,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args["seed"])
            model = Qwen2ForCausalLM(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    info = {
        "args": args,
        "vocab_size": n_vocab,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "built_by": "ferryman.tiny.build_tiny_model",
    }
    (out / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")


_TINY_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
"""The default shape when no preset is named."""


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 160,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    seed: int = 0,
    extra_corpus: list[str] | None = None,
    init_std: float = 0.02,
    max_positions: int | None = None,
    preset: str | None = None,
    dtype: Literal["float32", "bfloat16"] = "float32",
) -> Path:
    """Build (or reuse) a tiny Qwen2 model directory at ``path`` and return it.

    The directory gets a locally trained byte-level BPE tokenizer of at most ``vocab_size``
    tokens (specials and tool tags included; every digit is one token), the ChatML chat
    template :data:`CHAT_TEMPLATE`, and a float32 ``Qwen2ForCausalLM`` with random weights drawn
    from ``seed`` with standard deviation ``init_std`` (tied embeddings, ``max_positions`` positions, 512 by default: the transformers engine refuses
    longer prompts, so agents with long system prompts need more). At the
    default 0.02 the next-token distribution is close to uniform (a good start for RL) and
    greedy decoding mostly repeats the last token; a larger ``init_std`` (e.g. 0.2) gives varied
    greedy text, which makes exactness tests of engines more discriminating. The arguments are stored in
    ``ferryman_tiny.json``; a directory built with the same arguments is returned as is.
    A directory built with other arguments is replaced; a non-empty directory that was not
    built here raises :class:`FileExistsError`. The build is atomic (written aside, then
    renamed), so concurrent callers are safe.

    Without ``preset`` the shape is ``hidden_size`` (64), ``num_layers`` (2), ``num_heads`` (4)
    and ``num_kv_heads`` (2), with an MLP twice the hidden size. ``preset`` names a real shape of
    :data:`SHAPE_PRESETS` (e.g. ``"qwen2.5-0.5b"``, ``"qwen3-1.7b"``): its hidden, MLP, head and
    KV-head sizes, rope base, tied or untied embeddings and context length (unless
    ``max_positions`` is given), as a ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``; only
    ``num_layers`` may still be given (fewer layers of the real width, e.g. for a CPU test).
    The vocabulary stays the tiny tokenizer's. ``dtype`` is the stored weights' dtype (presets
    only; ``bfloat16`` halves a large shape's files). A preset model is initialised on the GPU
    when there is one (the same seed then gives other weights than on a CPU).
    """
    if preset is not None:
        if preset not in SHAPE_PRESETS:
            raise ValueError(f"build_tiny_model: unknown preset {preset!r} (allowed: {', '.join(SHAPE_PRESETS)})")
        fixed = [n for n, v in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)) if v is not None]
        if fixed:
            raise ValueError(f"build_tiny_model: preset {preset!r} fixes {', '.join(fixed)}; give only num_layers to shrink it")
        shape = SHAPE_PRESETS[preset]
        hidden_size, num_heads, num_kv_heads = shape.hidden_size, shape.num_heads, shape.num_kv_heads
        num_layers = shape.num_layers if num_layers is None else num_layers
        max_positions = shape.max_positions if max_positions is None else max_positions
    else:
        if dtype != "float32":
            raise ValueError("build_tiny_model: dtype applies to preset shapes only (the tiny shape is float32)")
        hidden_size = _TINY_SHAPE["hidden_size"] if hidden_size is None else hidden_size
        num_layers = _TINY_SHAPE["num_layers"] if num_layers is None else num_layers
        num_heads = _TINY_SHAPE["num_heads"] if num_heads is None else num_heads
        num_kv_heads = _TINY_SHAPE["num_kv_heads"] if num_kv_heads is None else num_kv_heads
        max_positions = 512 if max_positions is None else max_positions
    if vocab_size < min_vocab_size():
        raise ValueError(
            f"build_tiny_model: vocab_size={vocab_size} is too small; the byte alphabet, the "
            f"specials and the tool tags alone take {min_vocab_size()} tokens"
        )
    if preset is None:
        if hidden_size % num_heads:
            raise ValueError(f"build_tiny_model: hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        if (hidden_size // num_heads) % 2:
            raise ValueError("build_tiny_model: the head size (hidden_size / num_heads) must be even for rotary embeddings")
    if num_heads % num_kv_heads:
        raise ValueError(f"build_tiny_model: num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    if num_layers < 1:
        raise ValueError("build_tiny_model: num_layers must be >= 1")
    if not init_std > 0:
        raise ValueError(f"build_tiny_model: init_std must be > 0, got {init_std}")
    if max_positions < 16:
        raise ValueError(f"build_tiny_model: max_positions must be >= 16, got {max_positions}")

    target = Path(path)
    args = _build_args(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=seed,
        init_std=float(init_std),
        extra_corpus=extra_corpus,
    )
    if preset is not None:  # only then: directories built before presets keep their marker
        args["preset"] = preset
        args["shape"] = asdict(SHAPE_PRESETS[preset])
        args["dtype"] = dtype
        args["max_positions"] = int(max_positions)
    elif max_positions != 512:  # only then: directories built before this argument keep their marker
        args["max_positions"] = int(max_positions)
    if _read_marker(target) == args:
        return target
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"build_tiny_model: {str(target)!r} exists and is not a directory")
        if any(target.iterdir()) and _read_marker(target) is None:
            raise FileExistsError(
                f"build_tiny_model: {str(target)!r} is a non-empty directory that was not built by "
                "build_tiny_model; refusing to overwrite it"
            )

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.building-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_model(tmp, args, tiny_corpus(extra_corpus), max_positions=int(max_positions))
        if target.exists():
            if _read_marker(target) == args:  # a concurrent build finished first
                return target
            if any(target.iterdir()):
                shutil.rmtree(target)
            else:
                target.rmdir()
        try:
            os.rename(tmp, target)
        except OSError:
            if _read_marker(target) == args:  # lost a race against an identical build
                return target
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
