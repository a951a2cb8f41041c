"""The sandbox's containment parts one by one: the egress address policy and proxy, the
session forwarder's request checks, capabilities and the detached host tree, limits and their
defaults, a limit breach that stays raised, cgroups removed at stop."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from harbor.models.task.config import NetworkMode

from ferryman_env_harbor.contain import (
    CAPS_KEPT,
    CgroupError,
    EgressProxy,
    MemoryLimitExceededError,
    SessionForwarder,
    egress_allowed,
    host_addresses,
    path_allowed,
    v2_parent,
)

from .test_sandbox import make_env


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fd00::2", "fe80::1", "::ffff:127.0.0.1",
                                     "::ffff:10.0.0.1"])
def test_egress_refuses_loopback_private_and_reserved(address):
    assert not egress_allowed(address)


def test_egress_refuses_the_hosts_own_addresses_and_allows_public_ones():
    for a in host_addresses():
        assert not egress_allowed(str(a))
    for a in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):  # decided without any connection
        assert egress_allowed(a) or any(str(h) == a for h in host_addresses())


@pytest.mark.parametrize(("target", "ok"), [
    ("/sess/abc/v1/chat/completions", True), ("/sess/abc/v1/models?x=1", True), ("/sess/abd/v1/models", False),
    ("/sess/abc/../xyz/v1/models", False), ("/sess/abc/v1/%2e%2e/%2e%2e/xyz/v1", False), ("//sess/abc/v1", False),
    ("/sess/abc//v1", False), ("http://127.0.0.1:1/sess/abc/v1", False), ("/sess/abc\\..\\x", False), ("/", False),
])
def test_forwarder_path_rule(target, ok):
    assert path_allowed(target, "/sess/abc/") is ok


async def _raw(port: int, data: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = await asyncio.wait_for(r.read(), 5)
    w.close()
    return out


async def test_forwarder_relays_only_its_prefix_one_request_per_connection():
    seen: list[bytes] = []

    async def upstream(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        n = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), b"0"))
        body = await reader.readexactly(n) if n else b""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    fwd = SessionForwarder(sock, ("127.0.0.1", up_port), "/sess/abc/", max_body_bytes=1000)
    await fwd.start()
    port = sock.getsockname()[1]
    try:
        ok = await _raw(port, b"POST /sess/abc/v1/x HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello"
                              b"GET /sess/other/v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"hello")
        assert len(seen) == 1 and b"Connection: close" in seen[0] and b"keep-alive" not in seen[0]  # the pipelined 2nd is dropped
        for req, status in [
            (b"GET /sess/other/v1/models HTTP/1.1\r\n\r\n", b"403"),
            (b"GET /sess/abc/../other/v1/models HTTP/1.1\r\n\r\n", b"403"),
            (b"POST /sess/abc/v1/x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", b"411"),
            (b"POST /sess/abc/v1/x HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", b"413"),
            (b"GET /sess/abc/v1/x HTTP/1.1\r\nX: " + b"y" * 40000 + b"\r\n\r\n", b"431"),
            (b"nonsense\r\n\r\n", b"400"),
        ]:
            out = await _raw(port, req)
            assert out.split(b" ")[1] == status, (req[:60], out[:100])
        assert len(seen) == 1, "nothing refused reached the upstream"
        assert fwd.counters["forwarded"] == 1 and fwd.counters["refused/path"] == 2
    finally:
        await fwd.close()
        up.close()


async def test_egress_proxy_relays_to_allowed_addresses_and_refuses_the_rest():
    async def echo(reader, writer):
        writer.write(await reader.read(100))
        await writer.drain()
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    tport = target.sockets[0].getsockname()[1]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    # a policy that lets the test's loopback echo server through shows the relay; the default refuses it
    proxy = EgressProxy(sock, policy=lambda a: a == "127.0.0.1")
    await proxy.start()
    port = sock.getsockname()[1]
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"CONNECT 127.0.0.1:{tport} HTTP/1.1\r\n\r\n".encode())
        await w.drain()
        assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        w.write(b"ping")
        await w.drain()
        assert await asyncio.wait_for(r.read(), 5) == b"ping"
        w.close()
        out = await _raw(port, b"CONNECT localhost6.invalid:443 HTTP/1.1\r\n\r\n")
        assert out.split(b" ")[1] == b"403"
        proxy.policy = egress_allowed
        out = await _raw(port, f"CONNECT 127.0.0.1:{tport} HTTP/1.1\r\n\r\n".encode())
        assert out.split(b" ")[1] == b"403" and b"loopback, private or the host" in out
    finally:
        await proxy.close()
        target.close()


async def test_egress_inside_a_public_sandbox(tmp_path, sandbox_dir):
    """From inside: the egress proxy refuses the host's loopback, private ranges and the host's
    own addresses; a direct connection has no route (refused locally: no packet leaves)."""
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    await env.start(force_build=False)
    own = sorted(str(a) for a in host_addresses() if a.version == 4 and not a.is_loopback)
    try:
        targets = [f"127.0.0.1:{host.getsockname()[1]}", "10.0.0.1:443", "192.168.0.1:80", "169.254.169.254:80"]
        targets += [f"{a}:22" for a in own]
        script = "; ".join(
            f"curl -s -o /dev/null -w '%{{http_connect}}\\n' --max-time 5 --noproxy '' -p -x \"$HTTPS_PROXY\" https://{t}/ ; true" for t in targets)
        r = await env.exec(script)
        assert r.stdout.split() == ["403"] * len(targets), (r.stdout, r.stderr)
        r = await env.exec("python3 -c \"import socket,errno; s=socket.socket(); print(s.connect_ex(('10.0.0.1', 80)) == errno.ENETUNREACH)\"; "
                           "ip -o route; ip -o -6 route")
        assert r.stdout.split()[0] == "True" and len(r.stdout.split()) == 1, r.stdout
        assert env.network_counters()["egress/refused"] == len(targets)
    finally:
        await env.stop(delete=True)
        host.close()


async def test_no_network_sandbox_has_no_egress_proxy(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n", network_mode=NetworkMode.NO_NETWORK)
    await env.start(force_build=False)
    try:
        r = await env.exec("env | grep -ci _proxy; (exec 3<>/dev/tcp/127.0.0.1/3128) 2>/dev/null && echo open || echo closed")
        assert r.stdout.split() == ["0", "closed"]
    finally:
        await env.stop(delete=True)


async def test_capabilities_dropped_and_host_tree_detached(tmp_path, sandbox_dir):
    marker = Path("/tmp") / f"ferryman-contain-marker-{os.getpid()}"
    marker.write_text("host")
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    await env.start(force_build=False)
    try:
        r = await env.exec("grep CapBnd /proc/self/status | cut -f2; ls -a /; mount -t tmpfs none /mnt 2>&1 || echo no-mount; "
                           "echo 1 > /proc/sys/vm/drop_caches 2>&1 || echo no-sysctl; mknod /tmp/d b 8 0 2>&1 || echo no-mknod; "
                           f"ls {marker} /proc/1/root{marker} 2>&1 | grep -cE 'No such|Permission denied'")
        lines = r.stdout.splitlines()
        names = ["chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
                 "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
                 "sys_module", "sys_rawio", "sys_chroot"]
        want = sum(1 << names.index(c) for c in CAPS_KEPT if c in names)
        want |= sum(1 << bit for c, bit in (("audit_write", 29), ("setfcap", 31)) if c in CAPS_KEPT)
        assert int(lines[0], 16) == want
        assert ".oldroot" not in lines and "work" not in lines
        assert "no-mount" in lines and "no-sysctl" in lines and "no-mknod" in lines
        assert lines[-1] == "2", "the host's /tmp is visible"
    finally:
        await env.stop(delete=True)
        marker.unlink()


async def test_limits_come_from_the_task_with_defaults(tmp_path, sandbox_dir):
    from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig

    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    lim = env.resolved_limits()
    assert (lim.cpus, lim.memory_mb, lim.storage_mb, lim.pids) == (1.0, 2048, 2048, 1024)
    env.task_env_config = TaskEnvironmentConfig(cpus=0.5, memory_mb=96, storage_mb=24)
    env.options.pids_limit = 50
    await env.start(force_build=False)
    cg = env.cgroup
    dirs = list(cg.dirs.values())
    try:
        assert cg.in_force() == {"memory_bytes": (96 + 24) * 2**20, "pids": 50, "cpus": 0.5}
        r = await env.exec("df -k / | tail -1 | awk '{print $2}'; cat /proc/self/cgroup")
        assert r.stdout.split()[0] == str(24 * 1024)
        assert all(d.name in r.stdout for d in dirs[:1])  # the command runs in the sandbox's cgroup
    finally:
        await env.stop(delete=True)
    assert not any(d.exists() for d in dirs), "cgroups removed at stop"


async def test_a_limit_breach_is_raised_and_stays_raised(tmp_path, sandbox_dir):
    from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig

    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    env.task_env_config = TaskEnvironmentConfig(memory_mb=48, storage_mb=8)
    await env.start(force_build=False)
    try:
        assert env.cgroup.in_force()["memory_bytes"] == 56 * 2**20
        with pytest.raises(MemoryLimitExceededError, match="48 MiB"):
            await env.exec("python3 -c 'x = bytearray(256 * 2**20)'")
        with pytest.raises(MemoryLimitExceededError):  # an agent that catches it cannot carry on
            await env.exec("true")
        assert not isinstance(MemoryLimitExceededError("x"), RuntimeError)
    finally:
        await env.stop(delete=True)


async def test_enforce_limits_off_makes_no_cgroup(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n", enforce_limits=False)
    await env.start(force_build=False)
    try:
        assert env.cgroup is None
        assert (await env.exec("echo ok")).stdout == "ok\n"
    finally:
        await env.stop(delete=True)


def test_bad_proxy_url_is_refused_when_made(tmp_path, sandbox_dir):
    with pytest.raises(ValueError, match="loopback"):
        make_env(tmp_path, sandbox_dir, "FROM scratch\n", proxy_url="http://10.0.0.5:8000/sess/abc/v1")
    with pytest.raises(ValueError, match="expected http"):
        make_env(tmp_path, sandbox_dir, "FROM scratch\n", proxy_url="http://127.0.0.1:8000/v1")


def _cgroupfs(root: Path, tree: dict[str, tuple[str, str | None]]) -> None:
    """A directory tree laid out as a cgroup v2 mount (this machine is cgroup v1, so the choice of
    parent is tested on files; the kernel's own cgroups run the sandbox tests). ``tree``: path ->
    (cgroup.controllers, cgroup.subtree_control; None: a subtree_control the write fails on, as
    the kernel's EBUSY for a cgroup holding processes)."""
    for rel, (controllers, subtree) in tree.items():
        d = root / rel.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text(controllers + "\n")
        if subtree is None:
            (d / "cgroup.subtree_control").mkdir()  # reads and writes fail with an OSError
        else:
            (d / "cgroup.subtree_control").write_text(subtree + "\n")


NEEDED = {"memory", "pids", "cpu"}
ALL = "cpuset cpu io memory hugetlb pids"


def test_v2_parent_is_the_own_cgroup_when_it_hands_the_controllers_down(tmp_path):
    _cgroupfs(tmp_path, {"/": (ALL, ALL), "/svc": (ALL, ALL), "/svc/me": (ALL, ALL)})
    assert v2_parent(tmp_path, "/svc/me", NEEDED) == (tmp_path / "svc/me").resolve()


def test_v2_parent_enables_what_is_missing_when_it_may(tmp_path):
    _cgroupfs(tmp_path, {"/": (ALL, ALL), "/me": (ALL, "memory")})
    assert v2_parent(tmp_path, "/me", NEEDED) == (tmp_path / "me").resolve()
    assert (tmp_path / "me/cgroup.subtree_control").read_text() == "+cpu +pids"


def test_v2_parent_goes_up_past_a_cgroup_without_the_controllers(tmp_path):
    # the GPU machine: own cgroup /process_api/<id> has memory and io only, its parent can enable
    # the rest for its children, the root delegates all
    _cgroupfs(tmp_path, {"/": (ALL, ALL), "/process_api": (ALL, None), "/process_api/abc": ("memory io", None)})
    assert v2_parent(tmp_path, "/process_api/abc", NEEDED) == tmp_path.resolve()
    _cgroupfs(tmp_path / "b", {"/": (ALL, ALL), "/process_api": (ALL, "memory io"), "/process_api/abc": ("memory io", "")})
    assert v2_parent(tmp_path / "b", "/process_api/abc", NEEDED) == (tmp_path / "b/process_api").resolve()


def test_v2_parent_names_every_cgroup_tried_when_none_can(tmp_path):
    _cgroupfs(tmp_path, {"/": ("memory io", "memory io"), "/me": ("memory io", "")})
    with pytest.raises(CgroupError) as e:
        v2_parent(tmp_path, "/me", NEEDED)
    msg = str(e.value)
    assert "lacks ['cpu', 'pids']" in msg and str((tmp_path / "me").resolve()) in msg and "enforce_limits: false" in msg
