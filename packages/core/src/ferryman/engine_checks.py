"""Input checks every engine plugin makes the same way: a generate request, and the
``(name, tensor)`` pairs of a weight load. Engines call these first so that bad input gets a
ValueError naming the problem and changes nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ferryman.types import SamplingParams

__all__ = ["check_generate_request", "resolve_param_name", "check_named_tensors"]


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
