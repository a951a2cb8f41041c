"""``sequence``: long answers with a graded reward that a model trained from random weights learns.

The user asks for a digit sequence of ``length`` digits (32 by default); every digit is one token
of the tiny tokenizer, so the answer is ``length`` tokens and the end-of-turn token. Long answers
matter on a real pipeline: weight syncs land in the middle of generations, so partial rollout
really aborts and resumes them.

Patterns (``pattern``):

* ``repeat`` (default): "Repeat the digit 7, 32 times." → ``777…``. The easiest: every position
  asks for the prompt's digit, so every token of an answer carries a learning signal
  (``bench/results/sequence_cpu.md``: the reward rises from random weights on a CPU).
* ``count``: "Count up from 3, 32 digits." → ``34567890123…`` (each digit the previous one plus
  one, mod 10): a wrong first digit shifts every later one off its place.
* ``copy``: "Copy 3 1 4 1 5 9 …" → ``314159…``. Needs copying from the prompt at every position
  (attention over the prompt), the hardest of the three.

Reward (partial credit, in order): the share of the target's positions that the answer
reproduces, ``matches / max(len(answer), len(target))`` over characters (the answer stripped),
where ``matches`` counts the positions at which the answer has the target's character. The exact
answer scores 1; every missing, wrong or extra character costs ``1 / length``; random digits
score about 0.1, so the reward rises only as the policy learns the sequence. ``digit_credit``
(e.g. 0.1) gives a position holding another digit that much: a shaping term for a model trained
from random weights, whose first answers rarely hold a digit at all. (A longest-common-
subsequence score was tried first: random digits already get ~0.4 of it, and a tiny model
plateaued there.) ``sequence/exact`` (1 for the exact answer) and
``sequence/prefix`` (the share of the target matched from the start) are reported per run.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

import ferryman
from ferryman.config import PluginConfig
from ferryman.protocols import GenerateClient
from ferryman.specs import EnvSpec
from ferryman.types import SamplingParams, Trajectory


class SequenceEnvConfig(PluginConfig):
    type: Literal["sequence"] = "sequence"
    num_tasks: int = Field(100, ge=1)
    length: int = Field(32, ge=1, le=4096)
    """Digits of the target (= answer tokens before the end-of-turn token). Set
    ``rollout.max_tokens`` above it, so the model can stop on its own."""
    pattern: Literal["repeat", "count", "copy"] = "repeat"
    """What the target is (see the module docstring)."""
    digit_credit: float = Field(0.0, ge=0.0, lt=1.0)
    """Credit for a position that holds a digit, but not the target's (shaping for a model
    trained from random weights: it first learns to answer with digits, then with the right
    ones). 0: only right positions count."""


def score_sequence(text: str, target: str, digit_credit: float = 0.0) -> float:
    """``(matches + digit_credit × other_digits) / max(len(answer), len(target))``, where
    ``matches`` counts the positions at which the answer (stripped of surrounding whitespace)
    has the target's character and ``other_digits`` the positions within the target's length
    that hold another digit: 1.0 only for the exact target; a missing, wrong or extra character
    costs ``1 / len(target)`` (an extra one by lengthening the denominator)."""
    answer = text.strip()
    if not target:
        raise ValueError("score_sequence: empty target")
    matches = other = 0
    for a, t in zip(answer, target):
        if a == t:
            matches += 1
        elif a.isdigit():
            other += 1
    return (matches + digit_credit * other) / max(len(answer), len(target))


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_target(pattern: str, start: int, length: int, digits: str = "") -> str:
    if pattern == "count":
        return "".join(str((start + i) % 10) for i in range(length))
    if pattern == "repeat":
        return str(start) * length
    return digits


def make_prompt(pattern: str, start: int, length: int, digits: str = "") -> str:
    if pattern == "count":
        return f"Count up from {start}, {length} digits."
    if pattern == "repeat":
        return f"Repeat the digit {start}, {length} times."
    return "Copy " + " ".join(digits)


class SequenceEnv:
    resumable = True
    """A run is a function of the task and the model's outputs (replayed after a restart)."""

    def __init__(self, config: SequenceEnvConfig, tokenizer: Any, seed: int = 0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("sequence env: the tokenizer has no eos_token_id")
        self.eos_id = int(tokenizer.eos_token_id)
        rng = random.Random(seed)
        self._tasks = []
        for i in range(config.num_tasks):
            start = rng.randrange(10)
            digits = "".join(str(rng.randrange(10)) for _ in range(config.length)) if config.pattern == "copy" else ""
            self._tasks.append(
                {
                    "index": i,
                    "prompt": make_prompt(config.pattern, start, config.length, digits),
                    "target": make_target(config.pattern, start, config.length, digits),
                }
            )

    @classmethod
    def from_config(cls, config: SequenceEnvConfig, *, tokenizer: Any, seed: int = 0, **_: Any) -> SequenceEnv:
        return cls(config, tokenizer, seed)

    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> dict[str, Any]:
        return dict(self._tasks[index])

    async def run(self, task: dict[str, Any], request_id: str, client: GenerateClient, params: SamplingParams) -> Trajectory:
        messages = [{"role": "user", "content": task["prompt"]}]
        prompt_ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        traj = Trajectory(request_id=request_id, prompt_ids=prompt_ids)
        stop = sorted(set(params.stop_token_ids) | {self.eos_id})
        out = await client.generate(request_id, prompt_ids, params.replace(stop_token_ids=stop))
        traj.append_model_tokens(out)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        target = task["target"]
        traj.reward = score_sequence(text, target, self.config.digit_credit)
        answer = text.strip()
        traj.metrics["sequence/exact"] = 1.0 if answer == target else 0.0
        traj.metrics["sequence/prefix"] = common_prefix(answer, target) / len(target)
        return traj


@ferryman.hookimpl
def ferryman_register_envs() -> list[EnvSpec]:
    return [
        EnvSpec(
            "sequence", SequenceEnv.from_config, SequenceEnvConfig,
            "toy task: a 32-digit answer (count up, repeat, copy), graded by the share of positions right",
        )
    ]
