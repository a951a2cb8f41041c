"""bench/sequence_dynamics.py (GRPO on the sequence task without the pipeline) runs, and its
policy-movement measurement says 0 when the step moves nothing."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_steps(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "bench" / "sequence_dynamics.py"))["main"]
    common = ["--model-dir", str(tmp_path / "model"), "--steps", "2", "--tasks", "2", "--n", "2", "--length", "4", "--log-every", "1"]
    assert main([*common, "--lr", "0", "--out", str(tmp_path / "still.jsonl")]) == 0
    assert main([*common, "--lr", "1e-2", "--entropy", "0.01", "--out", str(tmp_path / "moves.jsonl")]) == 0
    still = [json.loads(x) for x in (tmp_path / "still.jsonl").read_text().splitlines()]
    moves = [json.loads(x) for x in (tmp_path / "moves.jsonl").read_text().splitlines()]
    assert [r["step"] for r in still] == [1, 2] == [r["step"] for r in moves]
    for r in still + moves:
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 < r["length"] <= 12  # --max-tokens default: length + 8
    # lr 0: AdamW moves nothing, so the log-probs after the step equal those before, bit for bit
    assert all(r["kl"] == 0.0 for r in still)
    # lr 1e-2 on the tiny model: the sampled tokens' log-probs change
    assert all(abs(r["kl"]) > 1e-6 for r in moves)
    assert "steps    2-   2" in capsys.readouterr().out
