"""The side channel beside the broadcast: bucket metadata from the sender to every receiver,
and hellos and reports from the receivers back.

Two implementations with one interface: ZeroMQ (PUB/SUB for metadata, PUSH/PULL for reports
and, for ``cuda_ipc``, the per-bucket acks; the default) and the group's TCPStore (keys; no
pyzmq needed). Messages are small JSON objects.
Metadata is numbered; a receiver checks that none is missing.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

IDLE_WAIT_S = 24 * 3600.0
"""How long an idle receiver on the store channel blocks on the next key (the sender closing
its store wakes it earlier)."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone."""


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
        self._pending: list[dict[str, Any]] = []

    def params(self) -> dict[str, Any]:
        return {"metadata": "zmq", "pub_port": self.pub_port, "pull_port": self.pull_port}

    def publish(self, msg: dict[str, Any]) -> None:
        msg = dict(msg, seq=self.seq)
        self.seq += 1
        self.pub.send(json.dumps(msg).encode())

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        if self.pull.poll(max(int(timeout_s * 1000), 0)):
            return json.loads(self.pull.recv())
        return None

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
            elif msg.get("op") in ("hello", "report", "pong", "ack"):
                self._pending.append(msg)
        return got

    def acks(self, sync: int, k: int, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        """Each receiver's ``ack`` of bucket ``k`` of sync ``sync`` (``cuda_ipc``: it is done
        with that bucket's buffer), until the deadline. Acks of earlier buckets are dropped."""
        self._pending = [m for m in self._pending if not (m.get("op") == "ack" and (m.get("sync", 0), m.get("k", 0)) < (sync, k))]
        return self.collect("ack", "ack", f"{sync}/{k}", ranks, deadline)

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

    def done(self, sync: int) -> None:
        pass

    def close(self) -> None:
        try:
            self.pub.send(json.dumps({"op": "close", "seq": self.seq}).encode())
        except Exception:  # noqa: BLE001
            pass
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

    def send(self, msg: dict[str, Any]) -> None:
        self.push.send(json.dumps(msg).encode())

    def recv(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next metadata message, or None after ``timeout_s`` (None: a short poll, for
        an idle loop that checks for shutdown)."""
        wait_ms = 200 if timeout_s is None else max(int(timeout_s * 1000), 0)
        while True:
            if not self.sub.poll(wait_ms):
                return None
            msg = json.loads(self.sub.recv())
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


class StoreSender:
    kind = "store"

    def __init__(self, store: Any) -> None:
        self.store = store
        self.seq = 0
        self._sync_keys: list[str] = []

    def params(self) -> dict[str, Any]:
        return {"metadata": "store"}

    def publish(self, msg: dict[str, Any]) -> None:
        key = f"m/{self.seq}"
        self.store.set(key, json.dumps(dict(msg, seq=self.seq)))
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
        return got

    def hellos(self, generation: str, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        return self._wait_keys({r: f"hello/{r}" for r in ranks}, deadline)

    def handshake(self, generation: str, ranks: list[int], deadline: float) -> list[int]:
        return []

    def collect(self, op: str, key: str, value: Any, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        assert op == "report" and key == "sync"
        return self._wait_keys({r: f"r/{value}/{r}" for r in ranks}, deadline)

    def acks(self, sync: int, k: int, ranks: list[int], deadline: float) -> dict[int, dict[str, Any]]:
        keys = {r: f"a/{sync}/{k}/{r}" for r in ranks}
        got = self._wait_keys(keys, deadline)
        for r in got:
            try:
                self.store.delete_key(keys[r])
            except Exception:  # noqa: BLE001
                pass
        return got

    def done(self, sync: int) -> None:
        """Drop the keys of a finished sync (every receiver has read them)."""
        for key in self._sync_keys:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001
                pass
        self._sync_keys = []

    def close(self) -> None:
        try:
            self.publish({"op": "close"})
        except Exception:  # noqa: BLE001
            pass


class StoreReceiver:
    kind = "store"

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.next_seq = 0
        self._report_n = 0

    def send(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "hello":
            key = f"hello/{self.rank}"
        elif msg["op"] == "report":
            key = f"r/{msg['sync']}/{self.rank}"
        elif msg["op"] == "ack":
            key = f"a/{msg['sync']}/{msg['k']}/{self.rank}"
        else:
            return
        self.store.set(key, json.dumps(msg))

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
        return json.loads(self.store.get(key))

    def handshake(self, generation: str, rank: int, deadline: float) -> None:
        return None

    def close(self) -> None:
        pass
