"""The ``sticky`` router's configuration (the ``router:`` section of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ferryman.config import PluginConfig


class StickyRouterConfig(PluginConfig):
    """Sticky sessions, least in flight for new ones, rebalancing, quarantine, hash routing.

    Example::

        router:
          type: sticky
          sticky_capacity: 10000
          rebalance_threshold: 1.5
          quarantine_s: 60
    """

    type: Literal["sticky"] = "sticky"

    mode: Literal["least_in_flight", "hash"] = "least_in_flight"
    """``least_in_flight``: a new session goes to the healthy replica with the fewest requests in
    flight (ties rotate), later turns stick to it. ``hash``: every request id maps to a replica by
    rendezvous hashing of (seed, request id, replica name) over the healthy replicas, the same in
    every process and run; no rebalancing."""

    sticky_capacity: int = Field(10_000, ge=1)
    """How many request ids the request-id → replica LRU remembers."""

    rebalance: bool = True
    """Move a sticky session off its replica when that replica is overloaded compared with the
    least loaded one (the session loses its prefix cache; counted in ``router/rebalances``).
    Off: sessions never move while their replica is healthy."""

    rebalance_threshold: float = Field(2.0, gt=1.0)
    """A session moves when ``(in_flight[its replica] + 1) / (in_flight[least loaded] + 1)``
    exceeds this ratio (and the gap below is reached)."""

    rebalance_min_gap: int = Field(6, ge=1)
    """… and its replica has at least this many more requests in flight than the least loaded
    one, so that small absolute differences never move a session."""

    quarantine_s: float | None = Field(60.0, gt=0)
    """After ``report_failure`` a replica gets no work for this many seconds (from its last
    reported failure), then is re-admitted. ``null``: only ``add_replica`` re-admits it."""

    stall_timeout_s: float | None = Field(None, gt=0)
    """Quarantine a replica that has requests in flight but has released none for this many
    seconds (it stopped answering). ``null``: off."""

    shared: bool = False
    """``false``: the router is an object in the calling process (the Rollouter), a decision is a
    dict lookup. ``true``: the state lives in an async Ray actor and the factory returns a client
    that batches concurrent calls; use it when several processes route over the same replicas."""

    actor_name: str | None = Field(None, min_length=1)
    """With ``shared: true``, a Ray actor name: every process whose factory uses the same name
    (in the same Ray namespace) shares one router. ``null``: an unnamed actor owned by the caller."""

    @model_validator(mode="after")
    def hash_mode_never_rebalances(self) -> StickyRouterConfig:
        if self.mode == "hash" and self.rebalance and "rebalance" in self.model_fields_set:
            raise ValueError(
                "rebalance: must be false with mode='hash' (hash routing is deterministic; moving "
                "sessions by load would break that); drop rebalance or use mode='least_in_flight'"
            )
        return self

    @model_validator(mode="after")
    def actor_name_needs_shared(self) -> StickyRouterConfig:
        if self.actor_name is not None and not self.shared:
            raise ValueError("actor_name: only used with shared=true; set shared: true or drop actor_name")
        return self

    @property
    def rebalance_effective(self) -> bool:
        """Whether sessions are moved by load (never in hash mode)."""
        return self.rebalance and self.mode == "least_in_flight"
