"""Input checks every engine plugin makes the same way: a generate request, and the
``(name, tensor)`` pairs of a weight load. Engines call these first so that bad input gets a
ValueError naming the problem and changes nothing.

A GPU engine's own ``load_weights`` (vLLM's, SGLang's) stops at the first unknown name or wrong
shape after loading the tensors before it, so an engine checks every bucket first against the
checkpoint it was started from: :func:`read_checkpoint_spec` reads the names and shapes from the
safetensors headers of ``model_path`` (no tensor data), :func:`check_bucket` validates a bucket
against them."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferryman.types import SamplingParams

__all__ = [
    "check_generate_request",
    "resolve_param_name",
    "check_named_tensors",
    "CheckpointSpec",
    "read_checkpoint_spec",
    "check_bucket",
]


def check_generate_request(
    who: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int | None,
    max_context: int | None,
) -> None:
    """Raise ValueError (prefixed with ``who``, e.g. ``"HFEngine.generate"``) when the prompt is
    empty, holds ids outside ``[0, vocab_size)``, leaves no room in ``max_context`` positions, or
    the sampling parameters are out of range."""
    if not prompt_ids:
        raise ValueError(f"{who}: prompt_ids is empty; give at least one token id")
    if params.max_tokens < 1:
        raise ValueError(f"{who}: max_tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0:
        raise ValueError(f"{who}: temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"{who}: top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"{who}: top_k must be -1 (off) or >= 1, got {params.top_k}")
    if vocab_size:
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{who}: prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if max_context is not None and len(prompt_ids) >= max_context:
        raise ValueError(
            f"{who}: prompt of {len(prompt_ids)} tokens leaves no room in the model's "
            f"context of {max_context} positions"
        )


def resolve_param_name(name: str, known: Mapping[str, Any]) -> str | None:
    """The key of ``known`` that ``name`` means; a leading ``model.`` may be missing or extra."""
    if name in known:
        return name
    if f"model.{name}" in known:
        return f"model.{name}"
    if name.startswith("model.") and name[len("model.") :] in known:
        return name[len("model.") :]
    return None


def check_named_tensors(
    items: Sequence[Any],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    who: str,
    require_float: bool = False,
) -> list[tuple[str, Any]]:
    """Validate ``(name, tensor)`` pairs against the expected ``shapes`` by parameter name;
    return them as ``(resolved name, tensor)`` pairs.

    Raises ``ValueError("{who}: nothing loaded: ...")`` listing every problem (not a pair, not a
    tensor, unknown name, wrong shape, and with ``require_float`` not floating point) when
    anything is wrong."""
    import torch

    out: list[tuple[str, Any]] = []
    problems: list[str] = []
    for item in items:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            problems.append(f"not a (name, tensor) pair: {item!r:.80}")
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a torch.Tensor ({type(tensor).__name__})")
            continue
        target = resolve_param_name(str(name), shapes)
        if target is None:
            problems.append(f"{name}: unknown parameter")
            continue
        expected = tuple(shapes[target])
        if tuple(tensor.shape) != expected:
            problems.append(f"{name}: shape {tuple(tensor.shape)} != expected {expected}")
            continue
        if require_float and not tensor.is_floating_point():
            problems.append(f"{name}: dtype {tensor.dtype} is not floating point")
            continue
        out.append((target, tensor))
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
        raise ValueError(f"{who}: nothing loaded: {shown}")
    return out


_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class CheckpointSpec:
    shapes: dict[str, tuple[int, ...]]
    """Parameter name (as in the checkpoint / the trainer's state dict) to shape."""
    vocab_size: int | None
    max_position_embeddings: int | None
    num_layers: int | None
    experts_per_token: int | None
    """MoE models: experts per token (``num_experts_per_tok``), for ``routed_experts``."""


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {length} bytes is not plausible")
        return json.loads(f.read(length))


def read_checkpoint_spec(model_path: str | Path) -> CheckpointSpec:
    """Names and shapes of the tensors in ``model_path`` (``*.safetensors``), plus the
    ``lm_head.weight`` a trainer sends for a model with tied embeddings."""
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(root)!r}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, meta in _header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in meta["shape"])
    config: dict[str, Any] = {}
    if (root / "config.json").is_file():
        config = json.loads((root / "config.json").read_text())
    text = config.get("text_config") or config
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]

    def num(key: str) -> int | None:
        value = text.get(key)
        return int(value) if value else None

    return CheckpointSpec(
        shapes=shapes,
        vocab_size=num("vocab_size"),
        max_position_embeddings=num("max_position_embeddings"),
        num_layers=num("num_hidden_layers"),
        experts_per_token=num("num_experts_per_tok"),
    )


def check_bucket(named_tensors: Any, spec: CheckpointSpec) -> list[tuple[str, Any]]:
    """Validate a bucket; return it as ``(checkpoint name, tensor)`` pairs. Raises ValueError
    listing every problem when anything is wrong (nothing is loaded then)."""
    try:
        items = list(named_tensors)
    except TypeError:
        raise ValueError(f"load_weights: expected a list of (name, tensor) pairs, got {type(named_tensors).__name__}") from None
    return check_named_tensors(items, spec.shapes, who="load_weights", require_float=True)
