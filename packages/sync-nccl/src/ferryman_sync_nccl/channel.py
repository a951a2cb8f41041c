"""The side channel beside the broadcast: bucket metadata from the sender to every receiver,
and hellos, acks and reports from the receivers back.

Two implementations with one interface: ZeroMQ (PUB/SUB for metadata, PUSH/PULL for reports
and, for ``cuda_ipc``, the acks; the default) and the group's TCPStore (keys; no pyzmq needed).
Messages are small JSON objects. Metadata is numbered; a receiver checks that none is missing.

Acks (``cuda_ipc``) are cumulative: an ack of bucket ``k`` says the receiver is done with every
bucket up to ``k`` of that sync, so a receiver that finds several buckets done sends one. On
ZeroMQ that is one message; on the TCPStore one key per bucket (the sender waits for the keys
of all receivers in one request and deletes them when the sync is over).

Closing is a handshake: the sender announces ``close``; each receiver leaves, frees its side of
the group and answers ``bye``; the sender waits for the byes (briefly) before it frees its own
side and the store, so no receiver finds the store gone under it.

Every endpoint counts what it does in ``stats``: ``sent`` and ``received`` messages and, on the
TCPStore, ``store_requests`` (each one a round trip to the store's server).
"""

from __future__ import annotations

import datetime
import json
import time
from collections import Counter
from typing import Any

IDLE_WAIT_S = 0.2
"""How long ``recv(None)`` waits (an idle receiver looks this often whether it should stop)."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone."""


def _ack_key(msg: dict[str, Any]) -> tuple[int, int]:
    return int(msg.get("sync", 0)), int(msg.get("k", -1))


# --------------------------------------------------------------------------- ZeroMQ


class ZmqSender:
    kind = "zmq"

    def __init__(self, host: str) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 500)  # let the final "close" reach the receivers
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        addr = f"tcp://{_zmq_host(host)}"
        self.pub_port = self.pub.bind_to_random_port(addr)
        self.pull_port = self.pull.bind_to_random_port(addr)
        self.seq = 0
        self.stats: Counter[str] = Counter()
        self._pending: list[dict[str, Any]] = []
        self._acked: dict[int, tuple[int, int]] = {}
        """Per rank, the latest (sync, bucket) it acked."""

    def params(self) -> dict[str, Any]:
        return {"metadata": "zmq", "pub_port": self.pub_port, "pull_port": self.pull_port}

    def publish(self, msg: dict[str, Any]) -> None:
        msg = dict(msg, seq=self.seq)
        self.seq += 1
        self.pub.send(json.dumps(msg).encode())
        self.stats["sent"] += 1

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        if self.pull.poll(max(int(timeout_s * 1000), 0)):
            self.stats["received"] += 1
            return json.loads(self.pull.recv())
        return None

    def _keep(self, msg: dict[str, Any]) -> None:
        """File a message nobody waits for now: acks update the per-rank high mark, the rest
        wait for a later :meth:`collect`."""
        op = msg.get("op")
        if op == "ack":
            rank = msg.get("rank")
            if isinstance(rank, int):
                self._acked[rank] = max(self._acked.get(rank, (-1, -1)), _ack_key(msg))
        elif op in ("hello", "report", "pong", "bye"):
            self._pending.append(msg)

    def collect(self, op: str, key: str, value: Any, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        """Messages ``op`` with ``msg[key] == value`` from each of ``ranks`` until the deadline
        (others are kept for a later call)."""
        got: dict[int, dict[str, Any]] = {}
        keep = []
        for msg in self._pending:
            if msg.get("op") == op and msg.get(key) == value and msg.get("rank") in ranks:
                got[msg["rank"]] = msg
            elif not (op == "report" and msg.get("op") == "report" and msg.get("sync", 0) < value):
                keep.append(msg)  # (late reports of an earlier, failed sync are dropped)
        self._pending = keep
        while len(got) < len(ranks):
            msg = self._recv(deadline - time.monotonic())
            if msg is None:
                break
            if msg.get("op") == op and msg.get(key) == value and msg.get("rank") in ranks:
                got[msg["rank"]] = msg
            else:
                self._keep(msg)
        return got

    def acked(self, sync: int, k: int, ranks: list[int], deadline: float) -> bool:
        """Whether every one of ``ranks`` has acked bucket ``k`` of sync ``sync`` (or a later
        one), waiting for their acks until ``deadline`` (a past deadline: only look)."""
        want = (sync, k)
        while True:
            if all(self._acked.get(r, (-1, -1)) >= want for r in ranks):
                return True
            msg = self._recv(deadline - time.monotonic())
            if msg is None:
                return False
            self._keep(msg)

    def unacked(self, sync: int, k: int, ranks: list[int]) -> list[int]:
        return [r for r in ranks if self._acked.get(r, (-1, -1)) < (sync, k)]

    def hellos(self, generation: str, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        return self.collect("hello", "generation", generation, ranks, deadline)

    def handshake(self, generation: str, ranks: list[int], deadline: float) -> list[int]:
        """Publish pings until every receiver's subscription answered one (a SUB socket misses
        what is published before it has connected). Returns the ranks that did not answer."""
        missing = set(ranks)
        n = 0
        while missing and time.monotonic() < deadline:
            self.pub.send(json.dumps({"op": "ping", "generation": generation, "n": n}).encode())
            n += 1
            got = self.collect("pong", "generation", generation, sorted(missing), min(deadline, time.monotonic() + 0.05))
            missing -= set(got)
        return sorted(missing)

    def byes(self, generation: str, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        """Each receiver's ``bye`` (it left and freed its side of the group), until the deadline."""
        return self.collect("bye", "generation", generation, ranks, deadline)

    def done(self, sync: int, buckets: int = 0) -> None:
        pass

    def announce_close(self) -> None:
        """Tell every receiver to stop (it answers with a bye)."""
        self.pub.send(json.dumps({"op": "close", "seq": self.seq}).encode())

    def close(self) -> None:
        self.pub.close()
        self.pull.close(0)
        self.ctx.term()


class ZmqReceiver:
    kind = "zmq"

    def __init__(self, params: dict[str, Any]) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        host = _zmq_host(params["host"])
        self.sub.connect(f"tcp://{host}:{params['pub_port']}")
        self.push.connect(f"tcp://{host}:{params['pull_port']}")
        self.next_seq = 0
        self.stats: Counter[str] = Counter()

    def send(self, msg: dict[str, Any]) -> None:
        self.push.send(json.dumps(msg).encode())
        self.stats["sent"] += 1

    def ack(self, sync: int, first: int, last: int, rank: int) -> None:
        """Done with buckets ``first`` .. ``last`` of sync ``sync`` (one message: acks are
        cumulative)."""
        self.send({"op": "ack", "sync": sync, "k": last, "rank": rank})

    def recv(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next metadata message, or None after ``timeout_s`` (None: :data:`IDLE_WAIT_S`;
        0: only look)."""
        wait_ms = max(int((IDLE_WAIT_S if timeout_s is None else timeout_s) * 1000), 0)
        while True:
            if not self.sub.poll(wait_ms):
                return None
            msg = json.loads(self.sub.recv())
            self.stats["received"] += 1
            if msg.get("op") in ("ping", "close"):
                return msg
            seq = msg.get("seq")
            if seq != self.next_seq:
                raise ChannelClosed(f"metadata message {self.next_seq} was lost (got {seq})")
            self.next_seq = seq + 1
            return msg

    def handshake(self, generation: str, rank: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            msg = self.recv(deadline - time.monotonic())
            if msg is not None and msg.get("op") == "ping" and msg.get("generation") == generation:
                self.send({"op": "pong", "generation": generation, "rank": rank})
                return
        raise TimeoutError("no ping from the sender on the metadata channel")

    def close(self) -> None:
        self.sub.close(0)
        self.push.close()
        self.ctx.term()


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# --------------------------------------------------------------------------- TCPStore


class _CountingStore:
    """The store, counting every request (each is a round trip to the store's server)."""

    def __init__(self, store: Any, stats: Counter[str]) -> None:
        self._store = store
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        stats = self._stats

        def call(*args: Any, **kw: Any) -> Any:
            stats["store_requests"] += 1
            return fn(*args, **kw)

        return call


class StoreSender:
    kind = "store"

    def __init__(self, store: Any) -> None:
        self.stats: Counter[str] = Counter()
        self.store = _CountingStore(store, self.stats)
        self.seq = 0
        self._sync_keys: list[str] = []
        self._ranks: list[int] = []

    def params(self) -> dict[str, Any]:
        return {"metadata": "store"}

    def publish(self, msg: dict[str, Any]) -> None:
        key = f"m/{self.seq}"
        self.store.set(key, json.dumps(dict(msg, seq=self.seq)))
        self.stats["sent"] += 1
        self._sync_keys.append(key)
        self.seq += 1

    def _wait_keys(self, keys: dict[int, str], deadline: float) -> dict[int, dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}
        for rank, key in keys.items():
            remaining = deadline - time.monotonic()
            try:
                if remaining > 0:
                    self.store.wait([key], _td(remaining))
                elif not self.store.check([key]):
                    continue
            except Exception:  # noqa: BLE001 - a timeout: that rank did not answer
                continue
            got[rank] = json.loads(self.store.get(key))
            self.stats["received"] += 1
        return got

    def hellos(self, generation: str, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        self._ranks = list(ranks)
        return self._wait_keys({r: f"hello/{r}" for r in ranks}, deadline)

    def handshake(self, generation: str, ranks: list[int], deadline: float) -> list[int]:
        return []

    def collect(self, op: str, key: str, value: Any, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        assert op == "report" and key == "sync"
        return self._wait_keys({r: f"r/{value}/{r}" for r in ranks}, deadline)

    def acked(self, sync: int, k: int, ranks: list[int], deadline: float) -> bool:
        """Whether every one of ``ranks`` has acked bucket ``k`` of sync ``sync``, waiting
        until ``deadline``: one request for all of them (a past deadline: one look)."""
        keys = [f"a/{sync}/{k}/{r}" for r in ranks]
        remaining = deadline - time.monotonic()
        try:
            if remaining > 0:
                self.store.wait(keys, _td(remaining))
                return True
            return bool(self.store.check(keys))
        except Exception:  # noqa: BLE001 - a timeout
            return False

    def unacked(self, sync: int, k: int, ranks: list[int]) -> list[int]:
        return [r for r in ranks if not self.store.check([f"a/{sync}/{k}/{r}"])]

    def byes(self, generation: str, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        return self._wait_keys({r: f"bye/{r}" for r in ranks}, deadline)

    def done(self, sync: int, buckets: int = 0) -> None:
        """Drop the keys of a finished sync (every receiver has read them): its metadata, and
        the acks of its ``buckets`` buckets (``cuda_ipc``)."""
        keys = self._sync_keys + [f"a/{sync}/{k}/{r}" for k in range(buckets) for r in self._ranks]
        self._sync_keys = []
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001
                pass

    def announce_close(self) -> None:
        self.publish({"op": "close"})

    def close(self) -> None:
        pass


class StoreReceiver:
    kind = "store"

    def __init__(self, store: Any, rank: int) -> None:
        self.stats: Counter[str] = Counter()
        self.store = _CountingStore(store, self.stats)
        self.rank = rank
        self.next_seq = 0

    def send(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "hello":
            key = f"hello/{self.rank}"
        elif msg["op"] == "report":
            key = f"r/{msg['sync']}/{self.rank}"
        elif msg["op"] == "ack":
            key = f"a/{msg['sync']}/{msg['k']}/{self.rank}"
        elif msg["op"] == "bye":
            key = f"bye/{self.rank}"
        else:
            return
        self.store.set(key, json.dumps(msg))
        self.stats["sent"] += 1

    def ack(self, sync: int, first: int, last: int, rank: int) -> None:
        """Done with buckets ``first`` .. ``last`` of sync ``sync``: one key each (the sender
        waits for the key of the bucket whose buffer it wants back)."""
        for k in range(first, last + 1):
            self.send({"op": "ack", "sync": sync, "k": k, "rank": rank})

    def recv(self, timeout_s: float | None) -> dict[str, Any] | None:
        import torch.distributed as dist

        key = f"m/{self.next_seq}"
        try:
            self.store.wait([key], _td(IDLE_WAIT_S if timeout_s is None else timeout_s))
        except dist.DistNetworkError as e:
            raise ChannelClosed(f"the sender's store is gone: {e}") from None
        except Exception:  # noqa: BLE001 - a timeout
            return None
        self.next_seq += 1
        self.stats["received"] += 1
        return json.loads(self.store.get(key))

    def handshake(self, generation: str, rank: int, deadline: float) -> None:
        return None

    def close(self) -> None:
        pass
