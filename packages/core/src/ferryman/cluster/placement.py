"""Placement groups of a run: one bundle per engine replica, one for the trainer.

A replica's bundle holds all of its GPUs (``rollout.num_gpus_per_replica``, its tensor-parallel
size for vLLM), so a replica never spans nodes; ``ray.placement_strategy`` decides how the
replicas spread over the nodes. The trainer's bundle is reserved first (it is the one that must
not wait behind the engines). A trainer plugin that starts rank actors of its own (FSDP with
``num_workers > 1``) reserves their bundles itself, packed per node.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ferryman.cluster.capacity import ClusterCapacityError, check_capacity, cluster_nodes

log = logging.getLogger(__name__)

_CONTROL_OPTIONS: dict[str, Any] = {}


def set_control_actor_options(options: dict[str, Any]) -> None:
    """Ray actor options for the control plane's actors (Rollouter, MessageQueue) in this
    driver: set by the runner, read by the actors' factories (core's ``ray`` queue)."""
    _CONTROL_OPTIONS.clear()
    _CONTROL_OPTIONS.update(options)


def control_actor_options() -> dict[str, Any]:
    return dict(_CONTROL_OPTIONS)


def _bundle(num_cpus: float, num_gpus: float, resources: dict[str, float], accelerator_type: str | None) -> dict[str, float]:
    b: dict[str, float] = {"CPU": float(num_cpus), "GPU": float(num_gpus), **{k: float(v) for k, v in resources.items()}}
    if accelerator_type:
        b[f"accelerator_type:{accelerator_type}"] = 0.001  # what Ray's own accelerator_type= option asks for
    return {k: v for k, v in b.items() if v > 0}


@dataclass(frozen=True)
class PlacementPlan:
    engine_bundle: dict[str, float]
    num_engines: int
    strategy: str
    trainer_bundle: dict[str, float]
    timeout_s: float

    def check(self, nodes: Any = None) -> dict[str, Any]:
        """:func:`check_capacity` against ``nodes`` (default: the connected cluster's)."""
        return check_capacity(
            cluster_nodes() if nodes is None else nodes,
            engine_bundle=self.engine_bundle,
            num_engines=self.num_engines,
            strategy=self.strategy,
            trainer_bundle=self.trainer_bundle,
        )

    def local_cpus(self) -> float:
        """CPUs a local Ray needs for this plan."""
        return self.engine_bundle.get("CPU", 0.0) * self.num_engines + self.trainer_bundle.get("CPU", 0.0)


def plan_placement(cfg: Any) -> PlacementPlan:
    e, t = cfg.ray.engine, cfg.ray.trainer
    return PlacementPlan(
        engine_bundle=_bundle(e.num_cpus, cfg.rollout.num_gpus_per_replica, e.resources, e.accelerator_type),
        num_engines=cfg.rollout.num_replicas,
        strategy=cfg.ray.placement_strategy,
        trainer_bundle=_bundle(t.num_cpus, t.num_gpus, t.resources, t.accelerator_type),
        timeout_s=cfg.ray.placement_timeout_s,
    )


def _actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    out: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}
    if custom:
        out["resources"] = custom
    return out


class Placement:
    """The reserved placement groups of one run (``await reserve()``, then ``release()``)."""

    def __init__(self, plan: PlacementPlan) -> None:
        self.plan = plan
        self.engine_pg: Any = None
        self.trainer_pg: Any = None

    async def _wait(self, pg: Any, what: str) -> None:
        import ray

        try:
            await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), self.plan.timeout_s)
        except TimeoutError:
            self.release()
            raise ClusterCapacityError(
                f"{what}: the cluster can hold it, but Ray could not reserve it within {self.plan.timeout_s:g} s "
                f"(ray.placement_timeout_s): other jobs hold the resources. Free now: {ray.available_resources()}"
            ) from None

    async def reserve(self) -> dict[str, Any]:
        """Check the cluster's capacity (raises :class:`ClusterCapacityError`), then reserve the
        trainer's bundle and the engines' placement group; returns the checked layout."""
        from ray.util.placement_group import placement_group

        layout = self.plan.check()
        p = self.plan
        if p.trainer_bundle:
            self.trainer_pg = placement_group([p.trainer_bundle], strategy="PACK", name="")
            await self._wait(self.trainer_pg, f"the trainer's bundle {p.trainer_bundle}")
        if p.engine_bundle and p.num_engines:
            self.engine_pg = placement_group([dict(p.engine_bundle) for _ in range(p.num_engines)], strategy=p.strategy, name="")
            await self._wait(self.engine_pg, f"{p.num_engines} engine bundle(s) of {p.engine_bundle} ({p.strategy})")
        return layout

    def engine_options(self, index: int) -> dict[str, Any]:
        opts = _actor_options(self.plan.engine_bundle)
        if self.engine_pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=self.engine_pg, placement_group_bundle_index=index)
        return opts

    def trainer_options(self) -> dict[str, Any]:
        opts = _actor_options(self.plan.trainer_bundle)
        if self.trainer_pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # the trainer plugin's own rank actors are not put into this group
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.trainer_pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=False
            )
        return opts

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in (self.engine_pg, self.trainer_pg):
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception as e:  # noqa: BLE001 - the cluster may be gone already
                    log.debug("removing a placement group: %r", e)
        self.engine_pg = self.trainer_pg = None
