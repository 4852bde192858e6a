"""A real Apache Kafka KRaft broker on loopback, started with plain ``java`` (a 3-node cluster of them:
:mod:`dora_rl.infra.broker.cluster`).

``LocalBroker`` is the embedded broker behind ``dora-rl`` when no ``--bootstrap-servers`` /
``DORA_BOOTSTRAP_SERVERS`` is given. Jars come from
Maven Central via :func:`~dora_rl.infra.broker.dist.ensure_kafka_jars`. A broker is a detached process
(own session) that outlives the command that started it; its data dir holds ``server.properties``,
``broker.log``, ``broker.pid`` and ``broker.json`` so later commands can :meth:`LocalBroker.attach`.

``security=None`` (default): one PLAINTEXT listener, no authentication. With a
:class:`~dora_rl.infra.broker.security.BrokerSecurity`: SASL_SSL (SCRAM-SHA-512) for clients and brokers,
TLS + PLAIN on the controller listener, ACLs enforced (docs/decisions/0018); the node's
``server.properties`` (which then holds passwords) is 0600 and no password is ever put in argv.
``launch_prefix`` (e.g. ``["ip", "netns", "exec", "ns1"]``) is prepended to the ``java`` command lines; it
must ``exec`` java (so the pid is the JVM's) and *host* must be reachable from the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dora_rl.infra.broker.dist import (
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
from dora_rl.infra.broker.security import BrokerSecrets, BrokerSecurity, SecurityAdmin
from dora_rl.infra.kafka.security import PLAINTEXT, ClientSecurity, write_private

__all__ = [
    "BROKER_JVM_OPTS",
    "DEFAULT_KAFKA_VERSION",
    "JVM_OPTS_ENV",
    "KAFKA_TOOLS",
    "BrokerError",
    "BrokerSecurity",
    "KafkaDistError",
    "LocalBroker",
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
#: HotSpot's default tiered JIT (C1, then C2) is kept: a fresh broker's C2 thread takes 0.4-0.5 of 2 cores for its
#: first ~3 minutes under load, but once settled the broker needs ~0.5 cores where C1 alone needs ~0.65, with no
#: better latency (decision 0038). ``DORA_BROKER_JVM_OPTS=-XX:TieredStopAtLevel=1`` trades that for no compile storm.
BROKER_JVM_OPTS = ("-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
JVM_OPTS_ENV = "DORA_BROKER_JVM_OPTS"
"""Extra JVM options for every broker this module starts, appended after ``jvm_opts`` (whitespace-separated)."""
STATE_FILE, PID_FILE, LOG_FILE = "broker.json", "broker.pid", "broker.log"
SCRAM_MARKER = "scram-admin.formatted"
"""Written after a secured format: the storage's metadata holds the admin's SCRAM credential."""
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


class BrokerUnreachable(RuntimeError):
    """No server of a bootstrap list accepts a connection (the user-facing commands say so in one line)."""


def require_reachable(bootstrap: str, timeout_s: float = 3.0) -> None:
    """Raise :class:`BrokerUnreachable` unless some ``host:port`` of ``bootstrap`` accepts a TCP connection
    within ``timeout_s`` (for the commands a person runs; roles rely on the client's own retries, so a
    broker restart never fails them)."""
    import socket

    reasons = []
    for entry in (e.strip() for e in bootstrap.split(",") if e.strip()):
        address = entry.split("://", 1)[-1]
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as exc:
            reasons.append(f"{entry}: {exc}")
    raise BrokerUnreachable(f"no Kafka broker at {bootstrap} ({'; '.join(reasons)}); start one with "
                            "`dora-rl broker start`, or leave out --bootstrap-servers to use the embedded broker")


class LocalBroker:
    """One KRaft node (combined broker+controller) listening on *host* (default 127.0.0.1).

    ``port=0`` picks free ports at :meth:`start` (the controller port defaults to ``port + 1``). The data
    dir survives restarts; storage is formatted only while ``<data_dir>/kraft/meta.properties`` is missing.
    *config* overrides or extends the generated ``server.properties``. *security* and *launch_prefix*: see
    the module docstring (a secured broker's material lives in ``<data_dir>/security`` unless its
    ``directory`` says otherwise; *host* is added to the certificate's hosts).
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
        security: BrokerSecurity | None = None,
        launch_prefix: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir or default_broker_dir()).expanduser().resolve()
        self.port = port
        self.controller_port = controller_port if controller_port is not None else (port + 1 if port else 0)
        self.version, self.heap, self.jvm_opts = version, heap, tuple(jvm_opts)
        self.config = dict(config or {})
        self.node_id, self.quorum_voters, self.cluster_id = node_id, quorum_voters, cluster_id
        self.cache_dir, self.host = cache_dir, host
        self.security = security.with_hosts(host) if security is not None else None
        self.launch_prefix = tuple(launch_prefix)
        self._secrets: BrokerSecrets | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log_file(self) -> Path:
        return self.data_dir / LOG_FILE

    @property
    def secrets(self) -> BrokerSecrets:
        """The TLS material and passwords of a secured broker (made on first use)."""
        if self.security is None:
            raise BrokerError("this broker runs PLAINTEXT: it has no security material")
        if self._secrets is None:
            self._secrets = self.security.materialize(self.data_dir / "security")
        return self._secrets

    def client_security(self) -> ClientSecurity:
        """What a client needs to reach this broker as its admin (super user); PLAINTEXT if unsecured."""
        return self.secrets.admin() if self.security is not None else PLAINTEXT

    def admin(self, timeout: float = 30.0) -> SecurityAdmin:
        """An admin of this (secured, running) broker's SCRAM users and ACLs."""
        return SecurityAdmin(self.bootstrap_servers, self.client_security(), timeout)

    @property
    def bootstrap_servers(self) -> str:
        """``<host>:<port>`` of the client listener (PLAINTEXT, or SASL_SSL when secured)."""
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
            sec = st.get("security")
            security = None if sec is None else BrokerSecurity(
                tuple(sec["hosts"]), Path(sec["directory"]), sec["admin_user"], sec["controller_user"])
            broker = cls(ddir, port=st["port"], controller_port=st["controller_port"], version=st["version"],
                         host=st.get("host", "127.0.0.1"), security=security,
                         launch_prefix=st.get("launch_prefix", ()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
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
            "security_protocol": "SASL_SSL" if self.security is not None else "PLAINTEXT",
            "client_config": str(self.secrets.client_config_file) if self.security is not None else None,
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
        listener_config = self._listener_config()
        text = template.format(
            listener_config=listener_config,
            node_id=self.node_id,
            voters=voters,
            host=self.host,
            port=self.port,
            controller_port=self.controller_port,
            log_dir=self.data_dir / "kraft",
            max_bytes=MAX_MESSAGE_BYTES,
        )
        text += "".join(f"{k}={v}\n" for k, v in self.config.items())  # later keys win (java Properties)
        self._write_config(self.properties_file, "# generated by dora_rl.infra.broker.server\n" + text)
        meta = self.data_dir / "kraft" / "meta.properties"
        scram_marker = self.data_dir / SCRAM_MARKER
        if meta.is_file():  # formatted before: keep its cluster id, never reformat
            ids = [
                ln.split("=", 1)[1] for ln in meta.read_text().splitlines() if ln.startswith("cluster.id=")
            ]
            self.cluster_id = ids[0].strip() if ids else self.cluster_id
            if self.security is not None and not scram_marker.is_file():
                raise BrokerError(f"{self.data_dir} was formatted without security, so its metadata holds no "
                                  "admin SCRAM credential: start the secured broker on a new data dir (or stop "
                                  f"this one and delete {self.data_dir / 'kraft'})")
            return
        self.cluster_id = self.cluster_id or new_cluster_id()
        args = ["format", "-t", self.cluster_id, "-c", str(self.properties_file)]
        main = "kafka.tools.StorageTool"
        argfile = self.data_dir / ".format.args"
        if self.security is not None:  # the admin's SCRAM password goes in a 0600 @argfile, never in argv
            quoted = [f'"{a}"' for a in (main, *args, *self.secrets.format_args())]
            self._write_config(argfile, "\n".join(quoted) + "\n", private=True)
            main, args = f"@{argfile}", []
        cmd = java_command(
            main,
            args,
            lib=lib,
            log4j2_config=tools_log4j2_config(),
            jvm_opts=("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"),
        )
        try:
            proc = subprocess.run([*self.launch_prefix, *cmd], capture_output=True, text=True, timeout=120,
                                  check=False)
        finally:
            argfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise BrokerError(f"kafka-storage format failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        if self.security is not None:
            scram_marker.write_text(f"{self.security.admin_user}\n")  # the admin credential is in the metadata

    def _listener_config(self) -> str:
        """The listener block of ``server.properties``: PLAINTEXT, or the secured one."""
        if self.security is None:
            return (f"listeners=PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}\n"
                    f"advertised.listeners=PLAINTEXT://{self.host}:{self.port}\n"
                    "inter.broker.listener.name=PLAINTEXT\n"
                    "controller.listener.names=CONTROLLER\n"
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT")
        props = self.secrets.server_properties(self.host, self.port, self.controller_port)
        return "\n".join(f"{k}={v}" for k, v in props.items())

    def _write_config(self, path: Path, text: str, private: bool | None = None) -> None:
        """Write a file the broker reads; 0600 when it may hold a secret (a secured broker's files)."""
        if self.security is not None if private is None else private:
            write_private(path, text)
        else:
            path.write_text(text)

    def _launch(self) -> None:
        """Start the JVM detached (own session, output to ``broker.log``); does not wait."""
        lib = ensure_kafka_jars(self.version, self.cache_dir)
        if self.log_file.exists():
            self.log_file.replace(self.log_file.with_name(LOG_FILE + ".1"))
        jvm = ["-Xms256m", f"-Xmx{self.heap}", *self.jvm_opts, *os.environ.get(JVM_OPTS_ENV, "").split()]
        if self.security is not None:  # SASL looks up peers' names: never wait on DNS (see jvm_hosts_file)
            hosts_file = self.secrets.jvm_hosts_file(self.data_dir / "jvm.hosts", self.security.hosts)
            jvm.append(f"-Djdk.net.hosts.file={hosts_file}")
        log4j2 = self.data_dir / "log4j2.properties"
        cmd = java_command(
            "kafka.Kafka", [str(self.properties_file)], lib=lib, log4j2_config=log4j2, jvm_opts=jvm
        )
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [*self.launch_prefix, *cmd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self._pid = self._proc.pid
        state = dict(pid=self._pid, bootstrap=self.bootstrap_servers, port=self.port, version=self.version)
        state.update(controller_port=self.controller_port, node_id=self.node_id, cluster_id=self.cluster_id)
        state.update(host=self.host, launch_prefix=list(self.launch_prefix))
        if self.security is not None:
            state["security"] = {"hosts": list(self.security.hosts), "directory": str(self.secrets.directory),
                                 "admin_user": self.security.admin_user,
                                 "controller_user": self.security.controller_user}
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
                self.cluster_id, self._pid, self.host = prev.cluster_id, prev._pid, prev.host
                self.security, self._secrets = prev.security, None  # a running broker's protocol is what it is
                return self
        deadline = time.monotonic() + timeout
        self._prepare()
        self._launch()
        try:
            self._wait_port(deadline)
            wait_for_brokers(self.bootstrap_servers, 1, deadline, security=self.client_security())
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
