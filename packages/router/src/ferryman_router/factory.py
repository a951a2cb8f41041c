"""The factory registered for ``type: sticky``: an in-process router, or a client of a shared actor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ferryman_router.config import StickyRouterConfig


def router_options(config: StickyRouterConfig, seed: int = 0) -> dict[str, Any]:
    """StickyRouter keyword arguments from a config."""
    return {
        "sticky_capacity": config.sticky_capacity,
        "mode": config.mode,
        "rebalance": config.rebalance_effective,
        "rebalance_threshold": config.rebalance_threshold,
        "rebalance_min_gap": config.rebalance_min_gap,
        "quarantine_s": config.quarantine_s,
        "stall_timeout_s": config.stall_timeout_s,
        "seed": seed,
    }


def make_router(config: StickyRouterConfig, *, replicas: Iterable[str], seed: int = 0, **_: Any) -> Any:
    """``shared: false`` → :class:`~ferryman_router.router.StickyRouter` (in this process);
    ``shared: true`` → :class:`~ferryman_router.shared.SharedStickyRouter` (Ray actor client)."""
    options = router_options(config, seed)
    if config.shared:
        from ferryman_router.shared import make_shared_router

        return make_shared_router(replicas, actor_name=config.actor_name, **options)
    from ferryman_router.router import StickyRouter

    return StickyRouter(replicas, **options)
