"""Can the cluster hold the run? A check on the nodes' total resources, before anything starts.

Ray itself only says "pending" for a placement group that can never be placed; this module
answers from ``ray.nodes()`` at once and names what is missing. The engine replicas' bundles are
all the same, so how many a node holds is exact (the smallest ``floor(capacity / need)`` over
the bundle's resources); the trainer's bundle is tried on every node that can take it.
Totals are used, not what is free now: resources held by other jobs make Ray wait
(``ray.placement_timeout_s``), they are not a configuration error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ferryman.config import ConfigError

_EPS = 1e-6


class ClusterCapacityError(ConfigError):
    """The cluster cannot hold what the run asks for (the message says what is missing).
    A :class:`~ferryman.config.ConfigError`: ``ferryman train`` prints it and exits with 2."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    resources: dict[str, float] = field(default_factory=dict)
    alive: bool = True


def cluster_nodes(all_nodes: bool = False) -> list[NodeInfo]:
    """The alive nodes (``all_nodes``: the dead ones too) of the connected Ray cluster, with
    their total resources."""
    import ray

    return [
        NodeInfo(n["NodeID"], n.get("NodeManagerAddress", "?"), {k: float(v) for k, v in n.get("Resources", {}).items()}, bool(n.get("Alive")))
        for n in ray.nodes()
        if all_nodes or n.get("Alive")
    ]


def _count(capacity: dict[str, float], bundle: dict[str, float]) -> float:
    """How many copies of ``bundle`` fit in ``capacity``."""
    best = math.inf
    for k, need in bundle.items():
        if need > 0:
            best = min(best, math.floor((capacity.get(k, 0.0) + _EPS) / need))
    return best


def _minus(capacity: dict[str, float], bundle: dict[str, float]) -> dict[str, float]:
    out = dict(capacity)
    for k, need in bundle.items():
        out[k] = out.get(k, 0.0) - need
    return out


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


def _node_line(node: NodeInfo, keys: set[str]) -> str:
    shown = {k: node.resources.get(k, 0.0) for k in sorted(keys)}
    return f"{node.address} ({node.node_id[:8]}) {_fmt(shown)}"


def _engines_fit(counts: list[float], n: int, strategy: str) -> bool:
    if n == 0:
        return True
    if strategy == "STRICT_PACK":
        return max(counts, default=0) >= n
    if strategy == "STRICT_SPREAD":
        return sum(1 for c in counts if c >= 1) >= n
    return sum(min(c, n) for c in counts) >= n


def check_capacity(
    nodes: list[NodeInfo],
    *,
    engine_bundle: dict[str, float],
    num_engines: int,
    strategy: str = "PACK",
    trainer_bundle: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Raise :class:`ClusterCapacityError` naming what is missing if ``num_engines`` copies of
    ``engine_bundle`` (placed with ``strategy``) and one ``trainer_bundle`` cannot all be held
    by ``nodes``; else return one possible layout (``{"trainer": node_id, "engines": {node_id: n}}``)."""
    if not nodes:
        raise ClusterCapacityError("the Ray cluster has no alive node")
    trainer_bundle = {k: v for k, v in (trainer_bundle or {}).items() if v > 0}
    engine_bundle = {k: v for k, v in engine_bundle.items() if v > 0}
    keys = set(engine_bundle) | set(trainer_bundle) | {"CPU", "GPU"}
    candidates: list[NodeInfo | None] = (
        [nd for nd in nodes if _count(nd.resources, trainer_bundle) >= 1] if trainer_bundle else [None]
    )
    for t in candidates:
        caps = [_minus(nd.resources, trainer_bundle) if nd is t else nd.resources for nd in nodes]
        counts = [_count(c, engine_bundle) for c in caps]
        if _engines_fit(counts, num_engines, strategy):
            layout: dict[str, int] = {}
            left = num_engines
            order = sorted(range(len(nodes)), key=lambda i: -min(counts[i], num_engines))
            for i in order:
                if left <= 0:
                    break
                take = 1 if strategy in ("STRICT_SPREAD", "SPREAD") else int(min(counts[i], left))
                if counts[i] >= 1 and take:
                    layout[nodes[i].node_id] = take
                    left -= take
            return {"trainer": t.node_id if t is not None else None, "engines": layout}

    # ------------------------------------------------------------------ say what is missing
    lines = [_node_line(nd, keys) for nd in nodes]
    problems: list[str] = []
    for who, bundle in (("the trainer", trainer_bundle), ("an engine replica", engine_bundle)):
        for k in sorted(bundle):
            if not any(nd.resources.get(k, 0.0) > 0 for nd in nodes):
                problems.append(f"{who} needs resource {k!r} and no node has it")
    if trainer_bundle and not candidates:
        best = {k: max(nd.resources.get(k, 0.0) for nd in nodes) for k in trainer_bundle}
        short = [f"{k}: {trainer_bundle[k]:g} wanted, at most {best[k]:g} on one node" for k in sorted(trainer_bundle) if best[k] + _EPS < trainer_bundle[k]]
        problems.append(f"no node can hold the trainer's {_fmt(trainer_bundle)}" + (f" ({'; '.join(short)})" if short else " (not all of it on one node)"))
    if num_engines and (candidates or not trainer_bundle):
        one = {k: max(nd.resources.get(k, 0.0) for nd in nodes) for k in engine_bundle}
        too_big = [f"{k}: {engine_bundle[k]:g} wanted, at most {one[k]:g} on one node" for k in sorted(engine_bundle) if 0 < one[k] + _EPS < engine_bundle[k]]
        if too_big:
            problems.append(
                f"no node can hold one engine replica's {_fmt(engine_bundle)} ({'; '.join(too_big)}); a replica, tensor "
                "parallel included, runs on one node"
            )
        else:
            held = 0.0
            for t in candidates:
                caps = [_minus(nd.resources, trainer_bundle) if nd is t else nd.resources for nd in nodes]
                counts = [min(_count(c, engine_bundle), num_engines) for c in caps]
                n_held = sum(1 for c in counts if c >= 1) if strategy == "STRICT_SPREAD" else (max(counts) if strategy == "STRICT_PACK" else sum(counts))
                held = max(held, n_held)
            need = {k: v * num_engines for k, v in engine_bundle.items()}
            have = {k: sum(nd.resources.get(k, 0.0) for nd in nodes) - trainer_bundle.get(k, 0.0) for k in engine_bundle}
            short = [
                f"{k}: {need[k]:g} wanted, {max(have[k], 0):g} in the cluster" + (" besides the trainer's" if k in trainer_bundle else "")
                for k in sorted(need) if have[k] + _EPS < need[k]
            ]
            where = {"STRICT_PACK": "all on one node", "STRICT_SPREAD": "each on its own node"}.get(strategy, f"strategy {strategy}")
            msg = f"{num_engines} engine replica bundles of {_fmt(engine_bundle)} ({where}) do not fit: the nodes hold {held:g}"
            if trainer_bundle:
                msg += f" besides the trainer's {_fmt(trainer_bundle)}"
            if short:
                msg += "; missing " + "; ".join(short)
            elif strategy == "STRICT_SPREAD":
                msg += f"; {num_engines} nodes that each hold one bundle are needed"
            elif strategy == "STRICT_PACK":
                msg += "; one node that holds them all is needed"
            problems.append(msg)
    if not problems:  # every part fits alone but not together
        problems.append(f"the trainer's {_fmt(trainer_bundle)} and {num_engines} × {_fmt(engine_bundle)} do not fit together")
    raise ClusterCapacityError(
        "the Ray cluster cannot hold this run:\n  - " + "\n  - ".join(problems) + "\n  nodes (total resources):\n    " + "\n    ".join(lines)
    )
