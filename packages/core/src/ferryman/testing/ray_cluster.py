"""A multi-node Ray cluster on one machine, for tests: ``ray start --head`` plus worker nodes.

Each node is a ``ray start --block`` process in a session of its own, so a node can be killed
as a whole (its raylet and its worker processes: what a machine that dies looks like to the
rest of the cluster) and the cluster stopped for certain in teardown. Every port is picked
free, the cluster keeps its files in a temporary directory of its own (another Ray on the
machine is not touched), and worker nodes get addresses of their own on the loopback network
(``127.0.0.2``, ``127.0.0.3``…), so a driver started here always attaches to the head node.
Node failures are detected within about a second (``RAY_health_check_*``).

    with LocalRayCluster(tmp_path, head_cpus=1, head_resources={"trainer_node": 1}) as c:
        worker = c.add_node(num_cpus=2, resources={"rollout_node": 2})
        subprocess.run([..., "ferryman", "train", ...], env=c.driver_env())
        c.kill_node(worker)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferryman.cluster.connect import free_port


@dataclass
class RayNode:
    name: str
    ip: str
    proc: subprocess.Popen[bytes]
    log: Path
    resources: dict[str, float]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalRayCluster:
    def __init__(
        self, base_dir: str | Path | None = None, *, head_cpus: float = 1, head_resources: dict[str, float] | None = None,
        start_timeout_s: float = 240.0,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ray-", dir=base_dir))
        # Ray's socket paths must stay short: the session lives in /tmp
        self.temp_dir = Path(tempfile.mkdtemp(prefix="frc-", dir="/tmp"))
        self.head_cpus = head_cpus
        self.head_resources = dict(head_resources or {})
        self.start_timeout_s = start_timeout_s
        self.port = free_port("")
        self.nodes: list[RayNode] = []
        self._ray = str(Path(sys.executable).with_name("ray"))
        self.head_ip: str | None = None

    # ------------------------------------------------------------------ life cycle
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(
            RAY_health_check_period_ms="500",
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold="4",
            RAY_agent_register_timeout_ms="300000",  # a loaded machine starts the node agents slowly
            RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
            RAY_USAGE_STATS_ENABLED="0",
            # a test cluster on this machine: no token auth, whatever ~/.ray holds (Ray turns it
            # on for a head when a token file exists, and the nodes must agree)
            RAY_AUTH_MODE="disabled",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        return env

    def _node_ports(self) -> list[str]:
        out = []
        for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                     "--runtime-env-agent-port", "--metrics-export-port"):
            out += [flag, str(free_port(""))]
        return out

    def _launch(self, name: str, ip: str | None, args: list[str], num_cpus: float, resources: dict[str, float]) -> RayNode:
        log = self.dir / f"{name}.log"
        cmd = [self._ray, "start", *args, "--num-cpus", str(int(num_cpus)), "--num-gpus", "0", "--block", "--disable-usage-stats",
               *self._node_ports()]
        if resources:
            cmd += ["--resources", json.dumps(resources)]
        if ip is not None:
            cmd += ["--node-ip-address", ip]
        with log.open("wb") as f:
            proc = subprocess.Popen(cmd, env=self._env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        node = RayNode(name, ip or "?", proc, log, {"CPU": float(num_cpus), **resources})
        self.nodes.append(node)
        self._wait_started(node)
        return node

    def _wait_started(self, node: RayNode) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = node.log.read_text(errors="replace") if node.log.exists() else ""
            if "Ray runtime started" in text:
                return
            if not node.alive:
                raise RuntimeError(f"ray node {node.name} exited while starting:\n{text[-3000:]}")
            time.sleep(0.3)
        raise RuntimeError(f"ray node {node.name} did not start within {self.start_timeout_s:.0f} s:\n{node.log.read_text(errors='replace')[-3000:]}")

    def start(self) -> LocalRayCluster:
        head = self._launch(
            "head", None,
            ["--head", "--port", str(self.port), "--temp-dir", str(self.temp_dir), "--include-dashboard", "false",
             "--ray-client-server-port", str(free_port(""))],
            self.head_cpus, self.head_resources,
        )
        text = head.log.read_text(errors="replace")
        ip = next((line.split("Local node IP:")[1].strip() for line in text.splitlines() if "Local node IP:" in line), "127.0.0.1")
        head.ip = self.head_ip = ip
        return self

    def add_node(self, *, num_cpus: float = 1, resources: dict[str, float] | None = None) -> RayNode:
        index = len(self.nodes) + 1
        return self._launch(f"node{index}", f"127.0.0.{index}", ["--address", self.address], num_cpus, dict(resources or {}))

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def driver_env(self, **extra: str) -> dict[str, str]:
        """Environment of a driver that joins this cluster (``RAY_ADDRESS`` set, as
        ``ray job submit`` does)."""
        env = self._env()
        env["RAY_ADDRESS"] = self.address
        env.update(extra)
        return env

    def kill_node(self, node: RayNode) -> None:
        """SIGKILL a node's raylet and every process it started: the node is lost."""
        if node.alive:
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(30)

    def stop(self) -> None:
        """Stop every node (workers first), whatever state they are in; remove the files."""
        for node in reversed(self.nodes):
            if node.alive:
                try:
                    os.killpg(node.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for node in reversed(self.nodes):
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # what is left of the node's session (workers that ignored SIGTERM)
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()
