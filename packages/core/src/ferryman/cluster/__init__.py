"""Running on a Ray cluster: joining one, placing the roles, checking that the cluster can hold them.

* :func:`connect` starts a local Ray for the run or joins an existing cluster
  (``ray.address`` / ``$RAY_ADDRESS``).
* :func:`plan_placement` turns the config into resource bundles (one per engine replica, one for
  the trainer); :func:`check_capacity` tells, from the cluster's nodes, whether they fit, and
  names what is missing before anything starts.
* :class:`Placement` reserves them as placement groups and hands out the scheduling strategies
  of the engine actors, the trainer and the control plane (Rollouter, MessageQueue).
* :class:`~ferryman.cluster.rank_group.RayRankGroup` (imported from its module) drives N trainer
  ranks (FSDP, Megatron) as Ray actors in one placement group, as one ``TrainerBackend``.
* :mod:`ferryman.cluster.processes` reads this machine's process tree from ``/proc`` (an
  engine's scheduler and workers: their GPU memory, or stopping them).
"""

from ferryman.cluster.capacity import ClusterCapacityError, NodeInfo, check_capacity, cluster_nodes
from ferryman.cluster.connect import connect, job_env_vars, resolve_address
from ferryman.cluster.placement import (
    Placement,
    PlacementPlan,
    control_actor_options,
    plan_placement,
    set_control_actor_options,
)

__all__ = [
    "ClusterCapacityError",
    "NodeInfo",
    "Placement",
    "PlacementPlan",
    "check_capacity",
    "cluster_nodes",
    "connect",
    "control_actor_options",
    "job_env_vars",
    "plan_placement",
    "resolve_address",
    "set_control_actor_options",
]
