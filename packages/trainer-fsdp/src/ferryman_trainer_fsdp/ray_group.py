"""Several FSDP ranks as Ray actors in one placement group, driven as one ``TrainerBackend``.

``trainer.num_workers: N`` (N > 1) makes the ``fsdp`` factory return a :class:`RayFSDPGroup`.
It reserves one bundle per rank (``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker``
GPUs each, strategy ``placement_strategy``), starts one :class:`FSDPWorker` actor per bundle,
gives them a rendezvous (rank 0's node address and a free port, as ``torchrun`` would through
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``), and each builds an ordinary
:class:`~ferryman_trainer_fsdp.trainer.FSDPTrainerBackend` that joins the group. Ray gives each
GPU actor its own ``CUDA_VISIBLE_DEVICES``, so every rank uses its ``cuda:0``.

Every call is sent to every rank (the ranks run the same SPMD program: collectives inside each
pass keep them in step) and rank 0's answer is returned; all ranks return the same tensors and
metrics (the backend all-reduces them). Weight buckets stream from rank 0 through a Ray
streaming generator while the other ranks iterate alongside it (their gathers are collectives),
so the full model is never held as one object. A method this class does not know is forwarded
the same way, so backend additions (checkpoint formats, say) work through the group unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class FSDPWorker:
    """One rank (a Ray actor). Not used directly: see :class:`RayFSDPGroup`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (asked of rank 0 for the rendezvous)."""
        import ray

        from ferryman_trainer_fsdp.trainer import _free_port

        # any interface: ranks on other nodes connect to this address
        return ray.util.get_node_ip_address(), _free_port("")

    def setup(self, master: tuple[str, int], config: Any, model_path: str, algorithm: Any, seed: int, threads: int | None) -> dict[str, Any]:
        from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend

        import torch

        if threads:
            torch.set_num_threads(threads)
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray restricts CUDA_VISIBLE_DEVICES to this actor's GPU
            LOCAL_WORLD_SIZE="1",
        )
        self.backend = FSDPTrainerBackend(config, model_path=model_path, algorithm=algorithm, seed=seed)
        return {"has_critic": self.backend.has_critic, "has_reference": self.backend.has_reference,
                "world_size": self.backend.world_size, "rank": self.backend.rank}

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


class RayFSDPGroup:
    """:class:`ferryman.protocols.TrainerBackend` over ``num_workers`` FSDP rank actors."""

    def __init__(self, config: Any, *, model_path: str, algorithm: Any, seed: int = 0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            from ferryman.runner import _no_uv_run_workers

            _no_uv_run_workers()
            ray.init(num_cpus=max(os.cpu_count() or 1, config.num_workers * config.num_cpus_per_worker),
                     include_dashboard=False, log_to_driver=False)
        n = int(config.num_workers)
        gpus = float(config.num_gpus_per_worker)
        if config.device.startswith("cuda") and gpus <= 0:
            gpus = 1.0
        self.config = config
        self.world_size = n
        self.rank = 0
        custom = {k: float(v) for k, v in getattr(config, "worker_resources", {}).items()}
        bundles = [{"CPU": float(config.num_cpus_per_worker), **({"GPU": gpus} if gpus > 0 else {}), **custom} for _ in range(n)]
        self._pg = placement_group(bundles, strategy=config.placement_strategy)
        self._remove_pg = remove_placement_group
        self.workers: list[Any] = []
        try:
            ready = self._pg.ready()
            ray.get(ready, timeout=config.placement_timeout_s)
        except Exception as e:
            remove_placement_group(self._pg)
            raise RuntimeError(
                f"trainer.num_workers={n}: Ray could not place {n} bundle(s) of {bundles[0]} within "
                f"{config.placement_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})"
            ) from e
        try:
            actor_cls = ray.remote(FSDPWorker)
            for rank in range(n):
                self.workers.append(
                    actor_cls.options(
                        num_cpus=config.num_cpus_per_worker,
                        num_gpus=gpus,
                        **({"resources": custom} if custom else {}),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self._pg, placement_group_bundle_index=rank
                        ),
                        name=None,
                    ).remote(rank, n)
                )
            master = ray.get(self.workers[0].address.remote())
            inner = config.model_copy(update={"num_workers": 1})
            infos = ray.get([
                w.setup.remote(master, inner, str(model_path), algorithm, seed, config.num_threads)
                for w in self.workers
            ])
        except BaseException:
            self.close()
            raise
        self.has_critic: bool = bool(infos[0]["has_critic"])
        self.has_reference: bool = bool(infos[0]["has_reference"])
        if any(i["world_size"] != n for i in infos):
            self.close()
            raise RuntimeError(f"FSDP ranks disagree on the world size: {infos}")

    # ------------------------------------------------------------------ fan-out
    def _all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        if not self.workers:
            raise RuntimeError(f"RayFSDPGroup.{method}: the group is closed")
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
        # only rank 0's argument is read (the backend broadcasts it): send the state once
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
        if name.startswith("_") or name in ("workers", "config"):
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
                log.warning("RayFSDPGroup.close: %r", e)
            for w in workers:
                ray.kill(w)
        pg = self.__dict__.get("_pg")
        if pg is not None:
            self._pg = None
            try:
                self._remove_pg(pg)
            except Exception as e:  # noqa: BLE001
                log.warning("RayFSDPGroup.close: removing the placement group: %r", e)
