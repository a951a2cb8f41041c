"""Reward functions and tools for the ``dataset`` env, and the arithmetic example's data.

``python -m ferryman_proxy.dataset_examples OUT_DIR`` writes ``arithmetic-train.jsonl`` and
``arithmetic-val.jsonl``: sums of two digits below 10, asked in three phrasings for training
and a fourth, held out, for validation (``examples/arithmetic.yaml``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(completion: str, answer: Any) -> float:
    """1.0 if the answer's text, stripped, equals ``str(answer)``, else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def first_number_reward(completion: str, answer: Any) -> dict[str, float]:
    """1.0 if the completion is exactly the number, 0.5 if it starts with it followed by more
    text, else 0.0 (``exact``: 1 for the first case)."""
    text, want = completion.strip(), str(answer).strip()
    if text == want:
        return {"reward": 1.0, "exact": 1.0}
    m = _NUMBER.match(text)
    return {"reward": 0.5 if m is not None and m.group(0) == want else 0.0, "exact": 0.0}


def calculator(a: int, b: int, op: str = "+") -> str:
    """Compute ``a op b`` for op one of + - * (integers)."""
    if op == "+":
        return str(int(a) + int(b))
    if op == "-":
        return str(int(a) - int(b))
    if op == "*":
        return str(int(a) * int(b))
    raise ValueError(f"unknown op {op!r}")


TRAIN_PHRASES = ("What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} =")
VAL_PHRASES = ("Compute {a}+{b}.",)


def arithmetic_rows(phrases: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every pair of digits whose sum is one digit, in each phrasing."""
    return [
        {"question": p.format(a=a, b=b), "answer": str(a + b)}
        for p in phrases
        for a in range(10)
        for b in range(10 - a)
    ]


def write_arithmetic(out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "arithmetic-train.jsonl", out / "arithmetic-val.jsonl")
    for path, phrases in zip(paths, (TRAIN_PHRASES, VAL_PHRASES)):
        path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(phrases)))
    return paths


if __name__ == "__main__":  # pragma: no cover
    print(*write_arithmetic(sys.argv[1] if len(sys.argv) > 1 else "examples/data"), sep="\n")
