"""Containment for the namespace sandbox: cgroup limits, the proxy-session forwarder and the
filtered egress proxy (see :mod:`ferryman_env_harbor.sandbox`).

* :class:`Cgroup` puts a sandbox's processes under memory, pids and CPU limits: cgroup v2 when
  ``/sys/fs/cgroup`` is a pure v2 mount, else the v1 ``memory``, ``pids`` and ``cpu``
  hierarchies (each nested under this process's own cgroup of that controller). It reports
  what is in force and whether a limit was hit (an OOM kill, a refused fork).
* :class:`SessionForwarder` listens on the proxy's own address *inside* the sandbox's network
  namespace and relays to the proxy only requests whose path lies under the run's session
  prefix, one request per connection, with limits on the request head and body. Nothing else of
  the host is reachable from the namespace (it has a loopback and no route).
* :class:`EgressProxy` (tasks that allow internet): an HTTP proxy inside the namespace
  (``HTTP_PROXY``/``HTTPS_PROXY`` point at it) whose connections the host makes only after
  resolving the destination and refusing any address that is not globally routable (loopback,
  private, link-local, shared, reserved ranges) or that belongs to the host itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MiB = 2**20
CAPS_KEPT = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap", "net_bind_service",
             "net_raw", "sys_chroot", "audit_write", "setfcap")
"""Capabilities a sandboxed process keeps (Docker's default set without ``mknod``). Dropped,
among others: sys_admin (mount, setns, namespaces), net_admin (routes, addresses), sys_module,
sys_rawio, sys_ptrace, sys_time, syslog, dac_read_search (open_by_handle_at), mknod, bpf,
perfmon, linux_immutable."""


# ---------------------------------------------------------------------------- limit errors
class SandboxLimitExceeded(Exception):  # noqa: N818 - a family of Harbor-facing errors
    """A sandbox hit one of its resource limits. Not a RuntimeError on purpose: agents catch
    RuntimeError from ``exec`` (command timeouts) and carry on; this must end the trial."""


class MemoryLimitExceededError(SandboxLimitExceeded):
    """Harbor's error policy knows this name: retryable, not graded, no valid reward."""


class PidsLimitExceededError(SandboxLimitExceeded):
    """A fork was refused by the pids limit."""


class StorageLimitExceededError(SandboxLimitExceeded):
    """The sandbox's writable storage is full."""


LIMIT_ERROR_POLICY: dict[str, dict[str, bool]] = {
    "PidsLimitExceededError": {"should_retry": False, "should_grade": False, "has_valid_reward": False},
    "StorageLimitExceededError": {"should_retry": False, "should_grade": False, "has_valid_reward": False},
    "MemoryLimitExceededError": {"should_retry": False, "should_grade": False, "has_valid_reward": False},
}
"""Harbor ``override_error_policy`` entries for the limit errors (HarborEnv sets them on every
trial: a trial that exceeded a limit is not graded and has no valid reward, and is not retried:
the same agent would do it again)."""


@dataclass(frozen=True)
class Limits:
    cpus: float
    memory_mb: int
    storage_mb: int
    pids: int

    @property
    def memory_bytes(self) -> int:
        """The memory cgroup's limit: the processes' memory plus the tmpfs holding the
        sandbox's writable storage (tmpfs pages are charged to the cgroup of their writer)."""
        return (self.memory_mb + self.storage_mb) * MiB


# ---------------------------------------------------------------------------- cgroups
def _own_cgroups() -> dict[str, str]:
    """controller (or ``""`` for v2) → this process's cgroup path."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _v1_mounts() -> dict[str, str]:
    """v1 controller → mount point."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if len(fields) >= 3 and fields[0] == "cgroup":
            for opt in fields[2].split(","):
                if opt in ("memory", "pids", "cpu"):
                    out.setdefault(opt, left.split()[4])
    return out


class CgroupError(RuntimeError):
    pass


def v2_parent(root: Path, own: str, needed: set[str]) -> Path:
    """The cgroup (v2, mounted at ``root``) under which a sandbox's cgroup gets the ``needed``
    controllers: this process's own cgroup ``own`` if it has them or can enable them for its
    children, else the lowest ancestor that can. A process in a leaf cgroup cannot enable
    controllers below itself (cgroup v2 lets no cgroup but the root both hold processes and hand
    controllers down: EBUSY), and a container's own cgroup is often given only some controllers
    (the project's GPU machine: ``/process_api/<id>`` without ``cpu`` and ``pids``, under a root
    that delegates all of them); the sandbox's cgroup then goes beside this process's, not
    below it. Raises :class:`CgroupError` naming each cgroup tried and why it could not."""
    root = root.resolve()
    p = (root / own.lstrip("/")).resolve()
    tried: list[str] = []
    while True:
        try:
            have = set((p / "cgroup.controllers").read_text().split())
            if not needed <= have:
                tried.append(f"{p} lacks {sorted(needed - have)}")
            else:
                enabled = set((p / "cgroup.subtree_control").read_text().split())
                if needed <= enabled:
                    return p
                try:
                    (p / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(needed - enabled)))
                    return p
                except OSError as e:
                    tried.append(f"{p} cannot enable {sorted(needed - enabled)} for its children ({e.strerror or e})")
        except OSError as e:
            tried.append(f"{p}: {e.strerror or e}")
        if p == root or root not in p.parents:
            raise CgroupError(f"cgroup v2: no cgroup from {own} up to the root can give a sandbox the {sorted(needed)} "
                              f"controllers: {'; '.join(tried)} (enforce_limits: false runs without limits)")
        p = p.parent


class Cgroup:
    """One sandbox's cgroup(s): made with the limits written, removed by :meth:`remove`."""

    def __init__(self, name: str, limits: Limits) -> None:
        self.name = name
        self.limits = limits
        self.version = 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1
        self.dirs: dict[str, Path] = {}
        own = _own_cgroups()
        try:
            if self.version == 2:
                parent = v2_parent(Path("/sys/fs/cgroup"), own.get("", "/"), {"memory", "pids", "cpu"})
                d = parent / name
                d.mkdir()
                self.dirs = {"memory": d, "pids": d, "cpu": d}
                (d / "memory.max").write_text(str(limits.memory_bytes))
                with contextlib.suppress(OSError):
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(limits.pids))
                (d / "cpu.max").write_text(f"{max(1000, int(limits.cpus * 100_000))} 100000")
            else:
                mounts = _v1_mounts()
                missing = [c for c in ("memory", "pids", "cpu") if c not in mounts]
                if missing:
                    raise CgroupError(f"no cgroup v1 hierarchy for {missing} and no cgroup v2 mount at /sys/fs/cgroup")
                for c in ("memory", "pids", "cpu"):
                    d = Path(mounts[c]) / own.get(c, "/").lstrip("/") / name
                    d.mkdir()
                    self.dirs[c] = d
                m = self.dirs["memory"]
                (m / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
                    (m / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
                (self.dirs["pids"] / "pids.max").write_text(str(limits.pids))
                (self.dirs["cpu"] / "cpu.cfs_period_us").write_text("100000")
                (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(max(1000, int(limits.cpus * 100_000))))
        except CgroupError:
            self.remove()
            raise
        except OSError as e:
            self.remove()
            raise CgroupError(f"cannot set up the sandbox's cgroup (needs root and writable memory, pids and cpu "
                              f"controllers): {e}") from None

    @property
    def procs_files(self) -> list[str]:
        """``cgroup.procs`` files a process must join (one per distinct directory)."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def in_force(self) -> dict[str, float]:
        """The limits as the kernel holds them: memory bytes, pids, CPUs."""
        if self.version == 2:
            d = self.dirs["memory"]
            quota, period = (d / "cpu.max").read_text().split()
            return {"memory_bytes": int((d / "memory.max").read_text()), "pids": int((d / "pids.max").read_text()),
                    "cpus": int(quota) / int(period)}
        return {
            "memory_bytes": int((self.dirs["memory"] / "memory.limit_in_bytes").read_text()),
            "pids": int((self.dirs["pids"] / "pids.max").read_text()),
            "cpus": int((self.dirs["cpu"] / "cpu.cfs_quota_us").read_text()) / int((self.dirs["cpu"] / "cpu.cfs_period_us").read_text()),
        }

    @staticmethod
    def _keyed(path: Path) -> dict[str, int]:
        out = {}
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                k, _, v = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = int(v)
        return out

    def events(self) -> dict[str, int]:
        """Limit hits so far: ``oom_kill`` (processes the memory limit killed) and
        ``pids_max`` (forks the pids limit refused)."""
        if self.version == 2:
            d = self.dirs["memory"]
            return {"oom_kill": self._keyed(d / "memory.events").get("oom_kill", 0),
                    "pids_max": self._keyed(d / "pids.events").get("max", 0)}
        return {"oom_kill": self._keyed(self.dirs["memory"] / "memory.oom_control").get("oom_kill", 0),
                "pids_max": self._keyed(self.dirs["pids"] / "pids.events").get("max", 0)}

    def usage(self) -> dict[str, int]:
        if self.version == 2:
            d = self.dirs["memory"]
            return {"memory_bytes": int((d / "memory.current").read_text()), "pids": int((d / "pids.current").read_text())}
        return {"memory_bytes": int((self.dirs["memory"] / "memory.usage_in_bytes").read_text()),
                "pids": int((self.dirs["pids"] / "pids.current").read_text())}

    def remove(self) -> None:
        """Remove the cgroup directories (their processes must be gone: the sandbox's pid
        namespace was killed). A directory still busy is retried briefly, then left."""
        import time

        for d in sorted(set(self.dirs.values()), key=str):
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                log.warning("sandbox cgroup %s still busy; left behind", d)
        self.dirs = {}


# ---------------------------------------------------------------------------- sockets in a netns
def listen_in_netns(netns_fd: int, host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` inside the network namespace ``netns_fd``
    (made on a short-lived thread that enters the namespace: network namespaces are per thread)."""
    result: dict[str, Any] = {}

    def work() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.setns(netns_fd, os.CLONE_NEWNET)
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                s = socket.socket(family, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen(128)
                s.setblocking(False)
                result["sock"] = s
            finally:
                os.setns(own, os.CLONE_NEWNET)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e
        finally:
            os.close(own)

    t = threading.Thread(target=work, name="ferryman-netns")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


# ---------------------------------------------------------------------------- HTTP helpers
MAX_HEAD_BYTES = 32 * 1024
MAX_HEADERS = 100


async def _send_error(writer: asyncio.StreamWriter, status: int, reason: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "sandbox_forwarder"}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    with contextlib.suppress(Exception):
        writer.write(head + body)
        await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, str, list[tuple[str, str]]] | str:
    """(method, target, version, headers), or an error string."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        return "431"
    except asyncio.IncompleteReadError:
        return "eof"
    lines = raw[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return "400"
    if len(lines) - 1 > MAX_HEADERS:
        return "431"
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return "400"
        headers.append((name, value.strip()))
    return parts[0], parts[1], parts[2], headers


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None = None) -> int:
    """Copy until EOF (or ``limit`` bytes); returns the bytes copied."""
    n = 0
    while limit is None or n < limit:
        chunk = await reader.read(65536 if limit is None else min(65536, limit - n))
        if not chunk:
            break
        n += len(chunk)
        writer.write(chunk)
        await writer.drain()
    return n


def _close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.close()


def path_allowed(target: str, prefix: str) -> bool:
    """Whether a request target lies under ``prefix``: origin-form, no dot segments, no
    percent-encoding, backslashes or empty segments that a server might resolve elsewhere."""
    path = target.split("?", 1)[0]
    if not path.startswith(prefix) or "%" in path or "\\" in path or "//" in path:
        return False
    return not any(seg in (".", "..") for seg in path.split("/"))


# ---------------------------------------------------------------------------- relays
class _Relay:
    """An asyncio TCP server on a given socket that relays each connection somewhere; the
    subclass's ``_relay`` does one connection's work. Here: the connection limit (503 over it),
    the bookkeeping of running connections (cancelled on close) and the cleanup of both ends."""

    busy_message = "too many connections"

    def __init__(self, sock: socket.socket, max_connections: int) -> None:
        self.sock = sock
        self.max_connections = max_connections
        self.counters: Counter[str] = Counter()
        self._server: asyncio.AbstractServer | None = None
        self._open = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._upstream: dict[asyncio.Task[Any] | None, asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self.sock, limit=MAX_HEAD_BYTES)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            self.sock.close()

    async def _connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the upstream connection of this connection (closed with it)."""
        up_r, up_w = await asyncio.open_connection(host, port)
        self._upstream[asyncio.current_task()] = up_w
        return up_r, up_w

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._open += 1
        try:
            if self._open > self.max_connections:
                self.counters["refused/connections"] += 1
                await _send_error(writer, 503, "Service Unavailable", self.busy_message)
            else:
                await self._relay(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            self.counters["errors"] += 1
        finally:
            self._open -= 1
            _close(self._upstream.pop(task, None))
            _close(writer)
            if task is not None:
                self._tasks.discard(task)


# ---------------------------------------------------------------------------- the session forwarder
class SessionForwarder(_Relay):
    """Relays HTTP requests from inside a sandbox to the proxy, only under ``prefix``."""

    busy_message = "too many connections from this sandbox"

    def __init__(self, sock: socket.socket, upstream: tuple[str, int], prefix: str, *,
                 max_body_bytes: int = 16 * MiB, max_connections: int = 32) -> None:
        super().__init__(sock, max_connections)
        self.upstream = upstream
        self.prefix = prefix
        self.max_body_bytes = max_body_bytes

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _read_head(reader)
        if isinstance(head, str):
            if head != "eof":
                self.counters[f"refused/{head}"] += 1
                await _send_error(writer, int(head), "Bad Request" if head == "400" else "Request Header Fields Too Large",
                                  "malformed or oversized request head")
            return
        method, target, version, headers = head
        if not path_allowed(target, self.prefix):
            self.counters["refused/path"] += 1
            return await _send_error(writer, 403, "Forbidden", "this sandbox may only reach its own proxy session")
        names = {k.lower(): v for k, v in headers}
        if "transfer-encoding" in names:
            self.counters["refused/chunked"] += 1
            return await _send_error(writer, 411, "Length Required", "chunked request bodies are not forwarded")
        try:
            length = int(names.get("content-length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            self.counters["refused/400"] += 1
            return await _send_error(writer, 400, "Bad Request", "bad Content-Length")
        if length > self.max_body_bytes:
            self.counters["refused/413"] += 1
            return await _send_error(writer, 413, "Payload Too Large", f"request body over {self.max_body_bytes} bytes")
        keep = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive", "proxy-connection",
                                                                 "proxy-authorization", "upgrade")]
        out = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in keep) + "Connection: close\r\n\r\n"
        up_r, up_w = await self._connect(*self.upstream)
        up_w.write(out.encode("latin-1"))
        sent = await _pipe(reader, up_w, length) if length else 0
        if sent < length:
            return
        self.counters["forwarded"] += 1
        await _pipe(up_r, writer)


# ---------------------------------------------------------------------------- egress
def host_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address of the host's interfaces (``ip -j addr``)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=5, check=True).stdout
        return {ipaddress.ip_address(a["local"].split("%")[0]) for i in json.loads(out) for a in i.get("addr_info", [])}
    except (OSError, ValueError, subprocess.SubprocessError, KeyError):
        return set()


_HOST_ADDRESSES: set[Any] | None = None


def egress_allowed(address: str) -> bool:
    """Whether the egress proxy may connect to ``address``: globally routable, not multicast and
    not one of the host's own addresses."""
    global _HOST_ADDRESSES
    if _HOST_ADDRESSES is None:
        _HOST_ADDRESSES = host_addresses()
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast and ip not in _HOST_ADDRESSES


class EgressProxy(_Relay):
    """An HTTP proxy (CONNECT, and absolute-form plain HTTP) that the host runs for a sandbox;
    ``policy(address)`` decides which resolved addresses may be reached (default
    :func:`egress_allowed`). The connection goes to the address that was checked, never to the
    name again (no DNS rebinding)."""

    def __init__(self, sock: socket.socket, policy: Callable[[str], bool] = egress_allowed, max_connections: int = 64) -> None:
        super().__init__(sock, max_connections)
        self.policy = policy

    async def _resolve(self, host: str, port: int) -> str | None:
        host = host.strip("[]")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return None
        addresses = [i[4][0] for i in infos]
        # every address the name has must pass, not just one (a name may list a private one first)
        if not addresses or not all(self.policy(a) for a in addresses):
            return ""
        return addresses[0]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _read_head(reader)
        if isinstance(head, str):
            return
        method, target, version, headers = head
        if method == "CONNECT":
            host, _, port_s = target.rpartition(":")
            rest = b""
        else:
            from urllib.parse import urlsplit

            u = urlsplit(target)
            if u.scheme != "http" or not u.hostname:
                return await _send_error(writer, 400, "Bad Request", "only CONNECT and absolute http:// requests")
            host, port_s = u.hostname, str(u.port or 80)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            keep = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive", "proxy-connection")]
            rest = (f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in keep)
                    + "Connection: close\r\n\r\n").encode("latin-1")
        try:
            port = int(port_s)
        except ValueError:
            return await _send_error(writer, 400, "Bad Request", "bad port")
        address = await self._resolve(host, port)
        if not address:
            self.counters["refused"] += 1
            why = "cannot resolve" if address is None else "destination is loopback, private or the host itself"
            return await _send_error(writer, 403, "Forbidden", f"egress to {host}:{port} refused: {why}")
        up_r, up_w = await self._connect(address, port)
        self.counters["connected"] += 1
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
        else:
            up_w.write(rest)
        pipes = [asyncio.ensure_future(_pipe(reader, up_w)), asyncio.ensure_future(_pipe(up_r, writer))]
        try:  # either side closing ends the tunnel
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pipes:
                p.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
