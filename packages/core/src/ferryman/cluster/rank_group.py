"""Several trainer ranks as Ray actors in one placement group, driven as one ``TrainerBackend``.

A trainer backend that runs SPMD over ``torch.distributed`` (FSDP, Megatron) becomes N Ray actors
with :class:`RayRankGroup`: one bundle per rank (CPUs, GPUs and custom resources, a placement
strategy), one :class:`RankWorker` actor per bundle, a rendezvous at rank 0's node address and a
free port (what ``torchrun`` gives through ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``), and on every rank the backend built by a named function (``"module:function"``,
called with the keywords given), which joins the default process group from those variables. Ray
gives each GPU actor its own ``CUDA_VISIBLE_DEVICES``, so every rank uses its ``cuda:0``
(``LOCAL_RANK=0``).

Every call is sent to every rank (the ranks run the same program: the collectives inside each
pass keep them in step) and rank 0's answer is returned: the backends return the same tensors and
metrics on every rank. Weight buckets stream from rank 0 through a Ray streaming generator while
the other ranks iterate alongside (their gathers are collectives), so the whole model is never
one object. A method the group does not wrap is forwarded the same way (checkpoint formats,
offload/onload, a backend's own additions).

Ray is imported only here, when a group is built.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from ferryman.cluster.connect import free_port, no_uv_run_workers

log = logging.getLogger(__name__)


def resolve(path: str) -> Any:
    """The object named ``"module:attribute"`` (a clear ``ValueError`` when it is not there)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {path!r}: {e}") from None


def settings_from_config(config: Any, *, model_path: str, algorithm: Any, seed: int) -> dict[str, Any]:
    """:class:`RayRankGroup` keywords (all but ``build``) from a trainer config with the usual
    rank-group fields (``num_workers``, ``num_cpus_per_worker``, ``num_gpus_per_worker``,
    ``placement_strategy``, ``worker_resources``, ``placement_timeout_s``; ``num_threads`` if it
    has one). Each rank's backend gets ``config`` with ``num_workers: 1`` (it is one rank)."""
    return {
        "build_kwargs": {"config": config.model_copy(update={"num_workers": 1}), "model_path": str(model_path),
                         "algorithm": algorithm, "seed": seed},
        "num_workers": config.num_workers,
        "num_cpus_per_worker": config.num_cpus_per_worker,
        "num_gpus_per_worker": config.num_gpus_per_worker,
        "placement_strategy": config.placement_strategy,
        "worker_resources": dict(config.worker_resources),
        "placement_timeout_s": config.placement_timeout_s,
        "num_threads": getattr(config, "num_threads", None),
    }


class RankWorker:
    """One rank (a Ray actor). Not used directly: see :class:`RayRankGroup`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (asked of rank 0 for the rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), free_port("")  # any interface: ranks on other nodes connect

    def setup(self, master: tuple[str, int], build: str, kwargs: dict[str, Any], threads: int | None) -> dict[str, Any]:
        if threads:
            import torch

            torch.set_num_threads(threads)
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray restricts CUDA_VISIBLE_DEVICES to this actor's GPU(s)
            LOCAL_WORLD_SIZE="1",
        )
        self.backend = resolve(build)(**kwargs)
        import torch.distributed as dist

        return {
            "has_critic": bool(getattr(self.backend, "has_critic", False)),
            "has_reference": bool(getattr(self.backend, "has_reference", False)),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }

    def process_group(self) -> tuple[int, int]:
        """This rank's (rank, world size) in the default ``torch.distributed`` group."""
        import torch.distributed as dist

        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.backend, method)(*args, **kwargs)

    def get_attr(self, name: str) -> Any:
        return getattr(self.backend, name)

    def stream_buckets(self, bucket_bytes: int) -> Iterator[Any]:
        """Rank 0: yields each bucket. Use with ``num_returns="streaming"``."""
        yield from self.backend.iter_weight_buckets(bucket_bytes)

    def drain_buckets(self, bucket_bytes: int) -> int:
        """Ranks > 0: iterate (taking part in every gather) and drop the tensors."""
        n = 0
        for _ in self.backend.iter_weight_buckets(bucket_bytes):
            n += 1
        return n

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


class RayRankGroup:
    """:class:`ferryman.protocols.TrainerBackend` over ``num_workers`` rank actors.

    ``build`` names the function that builds one rank's backend (``"module:function"``, called
    with ``build_kwargs`` on every rank after the rendezvous variables are set); ``label`` names
    the trainer in errors (``trainer.num_workers=N``)."""

    def __init__(
        self,
        *,
        build: str,
        build_kwargs: dict[str, Any],
        num_workers: int,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        placement_strategy: str = "PACK",
        worker_resources: dict[str, float] | None = None,
        placement_timeout_s: float = 300.0,
        num_threads: int | None = None,
        label: str = "trainer",
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resolve(build)  # a typo fails here, before any actor starts
        n = int(num_workers)
        if not ray.is_initialized():
            no_uv_run_workers()
            ray.init(num_cpus=max(os.cpu_count() or 1, int(n * num_cpus_per_worker + 0.999)),
                     include_dashboard=False, log_to_driver=False)
        self.label = label
        self.world_size = n
        self.rank = 0
        self.workers: list[Any] = []
        custom = {k: float(v) for k, v in (worker_resources or {}).items()}
        gpus = float(num_gpus_per_worker)
        bundles = [{"CPU": float(num_cpus_per_worker), **({"GPU": gpus} if gpus > 0 else {}), **custom} for _ in range(n)]
        self._pg = placement_group(bundles, strategy=placement_strategy)
        self._remove_pg = remove_placement_group
        try:
            ray.get(self._pg.ready(), timeout=placement_timeout_s)
        except Exception as e:
            remove_placement_group(self._pg)
            self._pg = None
            raise RuntimeError(
                f"{label}.num_workers={n}: Ray could not place {n} bundle(s) of {bundles[0]} within "
                f"{placement_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})"
            ) from e
        try:
            actor_cls = ray.remote(RankWorker)
            for rank in range(n):
                self.workers.append(
                    actor_cls.options(
                        num_cpus=num_cpus_per_worker,
                        num_gpus=gpus,
                        **({"resources": custom} if custom else {}),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self._pg, placement_group_bundle_index=rank
                        ),
                    ).remote(rank, n)
                )
            master = ray.get(self.workers[0].address.remote())
            kwargs_ref = ray.put(build_kwargs)
            infos = ray.get([w.setup.remote(master, build, kwargs_ref, num_threads) for w in self.workers])
        except BaseException:
            self.close()
            raise
        self.has_critic: bool = bool(infos[0]["has_critic"])
        self.has_reference: bool = bool(infos[0]["has_reference"])
        if any(i["world_size"] != n for i in infos):
            self.close()
            raise RuntimeError(f"{label} ranks disagree on the world size (expected {n}): {infos}")

    # ------------------------------------------------------------------ fan-out
    def _all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        if not self.workers:
            raise RuntimeError(f"{type(self).__name__}.{method}: the group is closed")
        refs = [ray.put(a) for a in args]  # one copy in the object store for all ranks
        krefs = {k: ray.put(v) for k, v in kwargs.items()}
        results = ray.get([w.call.remote(method, *refs, **krefs) for w in self.workers])
        return results[0]

    def compute_log_probs(self, batch: Any) -> Any:
        return self._all("compute_log_probs", batch)

    def compute_ref_log_probs(self, batch: Any) -> Any:
        return self._all("compute_ref_log_probs", batch)

    def compute_values(self, batch: Any) -> Any:
        return self._all("compute_values", batch)

    def update_actor(self, batch: Any) -> dict[str, float]:
        return self._all("update_actor", batch)

    def update_critic(self, batch: Any) -> dict[str, float]:
        return self._all("update_critic", batch)

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        return self._all("state_dict_for_checkpoint")

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        # only rank 0's argument is read (the backends broadcast it): send the state once
        import ray

        ref = ray.put(state)
        ray.get([w.call.remote("load_checkpoint_state", ref if i == 0 else None) for i, w in enumerate(self.workers)])

    @property
    def counters(self) -> dict[str, int]:
        import ray

        return ray.get(self.workers[0].get_attr.remote("counters"))

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[Any]:
        import ray

        if bucket_bytes <= 0:
            raise ValueError(f"iter_weight_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
        others = [w.drain_buckets.remote(bucket_bytes) for w in self.workers[1:]]
        stream = self.workers[0].stream_buckets.options(num_returns="streaming").remote(bucket_bytes)
        try:
            for ref in stream:
                yield ray.get(ref)
        finally:
            ray.get(others)

    def __getattr__(self, name: str) -> Any:
        # backend methods this class does not wrap: call on every rank, return rank 0's
        if name.startswith("_") or name in ("workers", "label", "world_size", "rank", "config"):
            raise AttributeError(name)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._all(name, *args, **kwargs)

        return forward

    def close(self) -> None:
        import ray

        workers, self.workers = self.__dict__.get("workers", []), []
        if workers:
            try:
                ray.get([w.close.remote() for w in workers], timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead rank must not stop the clean-up
                log.warning("%s.close: %r", type(self).__name__, e)
            for w in workers:
                ray.kill(w)
        pg = self.__dict__.get("_pg")
        if pg is not None:
            self._pg = None
            try:
                self._remove_pg(pg)
            except Exception as e:  # noqa: BLE001
                log.warning("%s.close: removing the placement group: %r", type(self).__name__, e)
