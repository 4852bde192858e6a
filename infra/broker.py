"""A real Apache Kafka KRaft broker (or a 3-node cluster) on loopback, started with plain ``java``.

``LocalBroker`` is the embedded broker behind ``dora-rl`` when no ``--bootstrap-servers`` /
``DORA_BOOTSTRAP_SERVERS`` is given; ``LocalCluster`` backs the fault-tolerance tests. Jars come from
Maven Central via :func:`~dora_rl.infra.kafka_dist.ensure_kafka_jars`. A broker is a detached process
(own session) that outlives the command that started it; its data dir holds ``server.properties``,
``broker.log``, ``broker.pid`` and ``broker.json`` so later commands can :meth:`LocalBroker.attach`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .kafka_dist import (
    DEFAULT_KAFKA_VERSION,
    KAFKA_TOOLS,
    KafkaDistError,
    dora_home,
    ensure_kafka_jars,
    free_port,
    is_kafka_process,
    java_command,
    new_cluster_id,
    package_file,
    pid_alive,
    port_open,
    run_kafka_tool,
    tools_log4j2_config,
    wait_for_brokers,
)

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "KAFKA_TOOLS",
    "BrokerError",
    "KafkaDistError",
    "LocalBroker",
    "LocalCluster",
    "broker_status",
    "default_broker_dir",
    "ensure_kafka_jars",
    "free_port",
    "resolve_bootstrap",
    "run_kafka_tool",
    "stop_broker",
]

DEFAULT_PORT = 19092
BOOTSTRAP_ENV = "DORA_BOOTSTRAP_SERVERS"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: SerialGC reaches "ready" ~1 s sooner than G1 on 2 cores (3.7 s vs 4.7 s) and runs no concurrent GC threads.
BROKER_JVM_OPTS = ("-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
STATE_FILE, PID_FILE, LOG_FILE = "broker.json", "broker.pid", "broker.log"
_RF_PREFIXES = ("default", "offsets.topic", "transaction.state.log", "share.coordinator.state.topic")
_RF_KEYS = [f"{p}.replication.factor" for p in _RF_PREFIXES]
_ISR_KEYS = ("min.insync.replicas", "transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr")


class BrokerError(RuntimeError):
    """The broker could not be started, or is not running when it should be."""


def default_broker_dir() -> Path:
    """Data dir of the embedded broker: ``$DORA_HOME/broker``."""
    return dora_home() / "broker"


def resolve_bootstrap(cli_value: str | None) -> str | None:
    """Bootstrap servers from the CLI flag, else ``$DORA_BOOTSTRAP_SERVERS``; ``None`` = embedded broker."""
    return cli_value or os.environ.get(BOOTSTRAP_ENV) or None


class LocalBroker:
    """One KRaft node (combined broker+controller) listening on 127.0.0.1.

    ``port=0`` picks free ports at :meth:`start` (the controller port defaults to ``port + 1``). The data
    dir survives restarts; storage is formatted only while ``<data_dir>/kraft/meta.properties`` is missing.
    *config* overrides or extends the generated ``server.properties``.
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        port: int = DEFAULT_PORT,
        controller_port: int | None = None,
        version: str = DEFAULT_KAFKA_VERSION,
        heap: str = "768m",
        jvm_opts: Sequence[str] = BROKER_JVM_OPTS,
        config: Mapping[str, object] | None = None,
        node_id: int = 1,
        quorum_voters: str | None = None,
        cluster_id: str | None = None,
        cache_dir: Path | str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir or default_broker_dir()).expanduser().resolve()
        self.port = port
        self.controller_port = controller_port if controller_port is not None else (port + 1 if port else 0)
        self.version, self.heap, self.jvm_opts = version, heap, tuple(jvm_opts)
        self.config = dict(config or {})
        self.node_id, self.quorum_voters, self.cluster_id = node_id, quorum_voters, cluster_id
        self.cache_dir, self.host = cache_dir, host
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log_file(self) -> Path:
        return self.data_dir / LOG_FILE

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:<port>`` of the PLAINTEXT listener."""
        if not self.port:
            raise BrokerError("port not chosen yet: call start() first")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the broker JVM while it runs, else None."""
        return self._pid if self.is_running() else None

    def is_running(self) -> bool:
        """True if the recorded PID is a live ``kafka.Kafka`` JVM for this data dir."""
        if self._pid is None:
            return False
        if self._proc is not None and self._proc.pid == self._pid:
            return self._proc.poll() is None  # our child: waitpid is exact (no zombie, sockets closed)
        return is_kafka_process(self._pid, str(self.properties_file))

    @classmethod
    def attach(cls, data_dir: Path | str | None = None) -> LocalBroker:
        """A handle on the broker recorded in *data_dir* by an earlier :meth:`start` (running or not)."""
        ddir = Path(data_dir or default_broker_dir()).expanduser().resolve()
        try:
            st = json.loads((ddir / STATE_FILE).read_text())
            broker = cls(ddir, port=st["port"], controller_port=st["controller_port"], version=st["version"])
        except (OSError, ValueError, KeyError) as exc:
            raise BrokerError(f"no broker state in {ddir} ({exc!r})") from exc
        broker.node_id, broker.cluster_id = st.get("node_id", 1), st.get("cluster_id")
        with contextlib.suppress(OSError, ValueError):
            broker._pid = int((ddir / PID_FILE).read_text().strip())
        return broker

    def status(self) -> dict[str, Any]:
        """Dict with running, pid, bootstrap_servers, version, data_dir, log_file, cluster_id."""
        running = self.is_running()
        return {
            "running": running,
            "pid": self._pid if running else None,
            "bootstrap_servers": f"{self.host}:{self.port}" if self.port else None,
            "version": self.version,
            "data_dir": str(self.data_dir),
            "log_file": str(self.log_file),
            "cluster_id": self.cluster_id,
        }

    def log_tail(self, lines: int = 40) -> str:
        """The last *lines* lines of ``broker.log``."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no broker log)"

    def _prepare(self) -> None:
        """Fetch jars, pick ports, write the configs, format the storage unless already formatted."""
        lib = ensure_kafka_jars(self.version, self.cache_dir)
        self.port = self.port or free_port(self.host)
        self.controller_port = self.controller_port or free_port(self.host)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "log4j2.properties").write_text(package_file("log4j2-broker.properties").read_text())
        template = package_file("server.properties").read_text()
        voters = self.quorum_voters or f"{self.node_id}@{self.host}:{self.controller_port}"
        text = template.format(
            node_id=self.node_id,
            voters=voters,
            host=self.host,
            port=self.port,
            controller_port=self.controller_port,
            log_dir=self.data_dir / "kraft",
            max_bytes=MAX_MESSAGE_BYTES,
        )
        text += "".join(f"{k}={v}\n" for k, v in self.config.items())  # later keys win (java Properties)
        self.properties_file.write_text("# generated by dora_rl.infra.broker\n" + text)
        meta = self.data_dir / "kraft" / "meta.properties"
        if meta.is_file():  # formatted before: keep its cluster id, never reformat
            ids = [
                ln.split("=", 1)[1] for ln in meta.read_text().splitlines() if ln.startswith("cluster.id=")
            ]
            self.cluster_id = ids[0].strip() if ids else self.cluster_id
            return
        self.cluster_id = self.cluster_id or new_cluster_id()
        args = ["format", "-t", self.cluster_id, "-c", str(self.properties_file)]
        cmd = java_command(
            "kafka.tools.StorageTool",
            args,
            lib=lib,
            log4j2_config=tools_log4j2_config(),
            jvm_opts=("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"),
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise BrokerError(f"kafka-storage format failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")

    def _launch(self) -> None:
        """Start the JVM detached (own session, output to ``broker.log``); does not wait."""
        lib = ensure_kafka_jars(self.version, self.cache_dir)
        if self.log_file.exists():
            self.log_file.replace(self.log_file.with_name(LOG_FILE + ".1"))
        jvm = ["-Xms256m", f"-Xmx{self.heap}", *self.jvm_opts]
        log4j2 = self.data_dir / "log4j2.properties"
        cmd = java_command(
            "kafka.Kafka", [str(self.properties_file)], lib=lib, log4j2_config=log4j2, jvm_opts=jvm
        )
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self._pid = self._proc.pid
        state = dict(pid=self._pid, bootstrap=self.bootstrap_servers, port=self.port, version=self.version)
        state.update(controller_port=self.controller_port, node_id=self.node_id, cluster_id=self.cluster_id)
        (self.data_dir / f".{STATE_FILE}.tmp").write_text(json.dumps(state, indent=1))
        (self.data_dir / f".{STATE_FILE}.tmp").replace(self.data_dir / STATE_FILE)
        (self.data_dir / PID_FILE).write_text(f"{self._pid}\n")

    def _wait_port(self, deadline: float) -> None:
        """Race "PLAINTEXT port open" (Kafka opens it only after metadata catch-up) against process exit."""
        while not port_open(self.host, self.port):
            if not self.is_running():
                rc = self._proc.poll() if self._proc is not None else None
                why = f"exited (code {rc}) before listening on {self.bootstrap_servers}"
            elif time.monotonic() > deadline:
                why = f"not listening on {self.bootstrap_servers} in time"
            else:
                time.sleep(0.1)
                continue
            raise BrokerError(f"Kafka broker {why}; last lines of {self.log_file}:\n{self.log_tail()}")

    def start(self, timeout: float = 90.0) -> LocalBroker:
        """Start the broker (or adopt the one already running on this data dir) and wait until it serves."""
        with contextlib.suppress(BrokerError):
            prev = LocalBroker.attach(self.data_dir)
            if prev.is_running():
                self.port, self.controller_port, self.version = prev.port, prev.controller_port, prev.version
                self.cluster_id, self._pid = prev.cluster_id, prev._pid
                return self
        deadline = time.monotonic() + timeout
        self._prepare()
        self._launch()
        try:
            self._wait_port(deadline)
            wait_for_brokers(self.bootstrap_servers, 1, deadline)
        except BaseException as exc:
            self.kill()
            if isinstance(exc, TimeoutError):
                raise BrokerError(f"{exc}; last lines of {self.log_file}:\n{self.log_tail()}") from exc
            raise
        return self

    def _signal_and_wait(self, sig: int, timeout: float) -> bool:
        """Signal the recorded broker (only if it is one) and wait until the process is fully gone."""
        pid = self._pid
        if pid is None or not self.is_running():
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + timeout
        child = self._proc if self._proc is not None and self._proc.pid == pid else None
        while child.poll() is None if child is not None else pid_alive(pid):
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM (controlled shutdown), SIGKILL after *timeout* s. True if a broker was running."""
        was_running = self.is_running()
        if not self._signal_and_wait(signal.SIGTERM, timeout):
            self._signal_and_wait(signal.SIGKILL, 10.0)
        with contextlib.suppress(OSError):
            (self.data_dir / PID_FILE).unlink()
        return was_running

    def kill(self) -> None:
        """SIGKILL the broker (simulates a crash; the data dir is left as it is)."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker({str(self.data_dir)!r}, port={self.port}, version={self.version!r})"


def broker_status(data_dir: Path | str | None = None) -> dict[str, Any]:
    """Status of the broker recorded in *data_dir* (default ``$DORA_HOME/broker``), for ``dora-rl broker``."""
    try:
        return LocalBroker.attach(data_dir).status()
    except BrokerError:
        ddir = Path(data_dir or default_broker_dir()).expanduser().resolve()
        return {"running": False, "pid": None, "bootstrap_servers": None, "data_dir": str(ddir)}


def stop_broker(data_dir: Path | str | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker recorded in *data_dir*; True if one was running."""
    try:
        return LocalBroker.attach(data_dir).stop(timeout)
    except BrokerError:
        return False


class LocalCluster:
    """*nodes* combined broker+controller nodes on loopback: RF 3, ``min.insync.replicas`` 2, static quorum.

    All nodes share one cluster id; each has its own dir ``<data_dir>/node<N>`` and free ports, recorded
    in ``<data_dir>/cluster.json`` so a cluster restarted on the same dir keeps them.
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        nodes: int = 3,
        version: str = DEFAULT_KAFKA_VERSION,
        heap: str = "512m",
        config: Mapping[str, object] | None = None,
        cache_dir: Path | str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir or dora_home() / "cluster").expanduser().resolve()
        self.size, self.version, self.heap, self.cache_dir = nodes, version, heap, cache_dir
        rf, isr = min(3, nodes), (2 if nodes >= 3 else 1)
        self.config: dict[str, object] = {**dict.fromkeys(_RF_KEYS, rf), **dict.fromkeys(_ISR_KEYS, isr)}
        self.config.update({"unclean.leader.election.enable": "false", "num.io.threads": 2, **(config or {})})
        self.nodes: list[LocalBroker] = []

    @property
    def bootstrap_servers(self) -> str:
        if not self.nodes:
            raise BrokerError("cluster not started")
        return ",".join(n.bootstrap_servers for n in self.nodes)

    def _build_nodes(self) -> None:
        state_file = self.data_dir / "cluster.json"
        try:
            st = json.loads(state_file.read_text())
            ports: list[list[int]] = st["ports"]
            cid: str = st["cluster_id"]
        except (OSError, ValueError, KeyError):
            ports, cid = [[free_port(), free_port()] for _ in range(self.size)], new_cluster_id()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            state_file.write_text(json.dumps({"ports": ports, "cluster_id": cid, "version": self.version}))
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        node = functools.partial(LocalBroker, version=self.version, heap=self.heap, config=self.config)
        node = functools.partial(node, quorum_voters=voters, cluster_id=cid, cache_dir=self.cache_dir)
        self.nodes = [
            node(self.data_dir / f"node{i + 1}", port=p, controller_port=c, node_id=i + 1)
            for i, (p, c) in enumerate(ports)
        ]

    def _wait_all(self, deadline: float) -> None:
        try:
            wait_for_brokers(self.bootstrap_servers, self.size, deadline)
        except TimeoutError as exc:
            tails = "\n".join(f"--- node {n.node_id}:\n{n.log_tail(15)}" for n in self.nodes)
            raise BrokerError(f"{exc}\n{tails}") from exc

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Format (first time only), start all nodes, wait until metadata lists every broker."""
        deadline = time.monotonic() + timeout
        self._build_nodes()
        try:
            for node in self.nodes:
                node._prepare()
            for node in self.nodes:
                node._launch()
            for node in self.nodes:
                node._wait_port(deadline)  # a node opens its port only once the quorum has a leader
            self._wait_all(deadline)
        except BaseException:
            self.stop(timeout=5.0)
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM all nodes at once (the quorum stays up while they shut down), SIGKILL stragglers."""
        for node in self.nodes:
            if node._pid is not None and node.is_running():
                os.kill(node._pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop(timeout)

    def kill_node(self, i: int) -> None:
        """SIGKILL node *i* (0-based index into :attr:`nodes`)."""
        self.nodes[i].kill()

    def restart_node(self, i: int, timeout: float = 90.0) -> None:
        """Start node *i* again on its data dir; wait until it serves metadata listing every broker."""
        deadline = time.monotonic() + timeout
        node = self.nodes[i]
        node.stop(timeout=10.0)
        node._launch()
        node._wait_port(deadline)
        try:  # ask the restarted node itself: the others may still list its previous incarnation
            wait_for_brokers(node.bootstrap_servers, self.size, deadline)
        except TimeoutError as exc:
            raise BrokerError(f"{exc}; last lines of {node.log_file}:\n{node.log_tail()}") from exc

    def node_index(self, node_id: int) -> int:
        """0-based index of the node whose Kafka ``node.id`` is *node_id*."""
        return next(i for i, n in enumerate(self.nodes) if n.node_id == node_id)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
