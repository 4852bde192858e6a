"""Fetch a real Apache Kafka distribution from Maven Central and run its Java classes (tools, broker JVMs).

No Kafka tarball or Docker image is needed: ``infra/broker/kafka/pom.xml`` (shipped as package data) lists the
broker (``kafka_2.13``), the CLI tools (``kafka-tools``) and the log4j 2 SLF4J binding that the published
POMs leave out. :func:`ensure_kafka_jars` resolves that POM once with ``mvn`` into
``$DORA_HOME/kafka/kafka-<version>/lib`` and :func:`run_kafka_tool` runs any Kafka CLI class with
``java -cp lib/*``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora_rl.infra.kafka.security import ClientSecurity

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "KAFKA_TOOLS",
    "KafkaDistError",
    "dora_home",
    "ensure_kafka_jars",
    "find_java",
    "free_port",
    "is_kafka_process",
    "java_command",
    "kafka_home",
    "new_cluster_id",
    "package_file",
    "pid_alive",
    "port_open",
    "run_kafka_tool",
    "tools_log4j2_config",
    "wait_for_brokers",
]

#: Newest Kafka whose whole dependency closure is on Maven Central. 4.4.0 is only partly published
#: (``kafka_2.13:4.4.0`` needs ``kafka-tools-api:4.4.0``, which Central does not have), so it cannot be
#: resolved yet; pass ``version="4.4.0"`` (or set ``DORA_KAFKA_VERSION``) once it is.
DEFAULT_KAFKA_VERSION = os.environ.get("DORA_KAFKA_VERSION", "4.3.1")

DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
_MARKER = ".complete"

#: Script name of the Kafka tarball -> main class (Kafka 4.x).
KAFKA_TOOLS: dict[str, str] = {
    "kafka-topics": "org.apache.kafka.tools.TopicCommand",
    "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "kafka-console-producer": "org.apache.kafka.tools.ConsoleProducer",
    "kafka-consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "kafka-producer-perf-test": "org.apache.kafka.tools.ProducerPerformance",
    "kafka-consumer-perf-test": "org.apache.kafka.tools.ConsumerPerformance",
    "kafka-get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "kafka-metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",
    "kafka-transactions": "org.apache.kafka.tools.TransactionsCommand",
    "kafka-broker-api-versions": "org.apache.kafka.tools.BrokerApiVersionsCommand",
    "kafka-configs": "kafka.admin.ConfigCommand",
    "kafka-storage": "kafka.tools.StorageTool",
    "kafka-dump-log": "kafka.tools.DumpLogSegments",
}

#: JVM flags for short-lived CLI tools: small heap, C1 only (starts ~30 % faster).
TOOL_JVM_OPTS: tuple[str, ...] = (
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)


class KafkaDistError(RuntimeError):
    """The Kafka jars could not be fetched, or ``java``/``mvn`` is missing."""


def dora_home() -> Path:
    """Return ``$DORA_HOME`` (default ``~/.cache/dora-rl``)."""
    return Path(os.environ.get("DORA_HOME") or Path.home() / ".cache" / "dora-rl").expanduser()


def kafka_home(version: str = DEFAULT_KAFKA_VERSION, cache_dir: Path | str | None = None) -> Path:
    """Return the directory holding ``lib/`` and ``config/`` of one Kafka version (may not exist yet)."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else dora_home() / "kafka"
    return base.resolve() / f"kafka-{version}"


def package_file(name: str) -> Path:
    """Path of a file shipped in ``dora_rl/infra/kafka/`` (pom.xml, properties templates)."""
    path = Path(__file__).resolve().parent / "kafka" / name
    if not path.is_file():
        raise KafkaDistError(f"package data missing: {path} (reinstall dora-rl)")
    return path


def find_java() -> str:
    """Return the ``java`` executable (``$JAVA_HOME/bin/java`` first, then ``PATH``)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise KafkaDistError(
            "`java` not found: install a JDK >= 17 (e.g. apt-get install openjdk-17-jdk-headless)"
        )
    return java


def _find_mvn() -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaDistError(
            "`mvn` not found: Maven is needed once to fetch the Kafka jars from Maven Central "
            "(e.g. apt-get install maven), or set DORA_HOME to a cache that already holds them"
        )
    return mvn


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on *path* (serialises concurrent fetches of one version)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_kafka_jars(
    version: str = DEFAULT_KAFKA_VERSION,
    cache_dir: Path | str | None = None,
    *,
    timeout: float = 900.0,
) -> Path:
    """Make sure the jars of Kafka *version* are cached and return their ``lib`` directory.

    The first call runs ``mvn … maven-dependency-plugin:3.8.1:copy-dependencies`` on the packaged POM
    (downloads ~45 MB into ``~/.m2`` and copies them to ``<cache>/kafka-<version>/lib``); later calls
    only check a marker file that is written after a successful copy, so an interrupted fetch is redone.
    *cache_dir* defaults to ``$DORA_HOME/kafka``.
    """
    home = kafka_home(version, cache_dir)
    lib = home / "lib"
    marker = home / _MARKER
    if marker.is_file():
        return lib
    find_java()  # fail early and clearly: jars without a JVM are useless
    mvn = _find_mvn()
    with _file_lock(home.parent / f".kafka-{version}.lock"):
        if marker.is_file():  # another process finished the fetch while we waited
            return lib
        home.mkdir(parents=True, exist_ok=True)
        pom = home / "pom.xml"  # mvn runs on a private copy: the package dir may be read-only
        shutil.copyfile(package_file("pom.xml"), pom)
        tmp = home / f"lib.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        # -U: retry artifacts whose absence Maven has cached (e.g. a release still being published)
        cmd = [mvn, "-B", "-q", "-U", "-Dstyle.color=never", "-f", str(pom), f"-Dkafka.version={version}"]
        cmd += [
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={tmp}",
        ]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise KafkaDistError(f"fetching Kafka {version} jars timed out after {timeout:.0f}s") from exc
        broker_jar = tmp / f"kafka_2.13-{version}.jar"
        if proc.returncode != 0 or not broker_jar.is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr).strip()  # drop ANSI colours
            out = "\n".join(out.splitlines()[-25:])
            raise KafkaDistError(
                f"could not fetch Kafka {version} from Maven Central (mvn exit {proc.returncode}); is the "
                f"version fully published and Maven Central reachable?\n  $ {' '.join(cmd)}\n{out}"
            )
        shutil.rmtree(lib, ignore_errors=True)
        tmp.rename(lib)
        jars = sorted(p.name for p in lib.glob("*.jar"))
        took = time.monotonic() - t0
        marker.write_text(
            f"kafka {version}: {len(jars)} jars fetched in {took:.1f}s\n" + "\n".join(jars) + "\n"
        )
    return lib


def tools_log4j2_config() -> Path:
    """The quiet log4j2 config for CLI tools (errors only, to stderr)."""
    return package_file("log4j2-tools.properties")


def java_command(
    main_class: str,
    args: Sequence[str],
    *,
    lib: Path,
    log4j2_config: Path,
    jvm_opts: Sequence[str] = (),
) -> list[str]:
    """Build ``java <jvm_opts> -cp <lib>/* -Dlog4j2.configurationFile=… <main_class> <args>``."""
    return [
        find_java(),
        *jvm_opts,
        "-cp",
        str(lib / "*"),
        f"-Dlog4j2.configurationFile={log4j2_config}",
        main_class,
        *args,
    ]


def run_kafka_tool(
    main_class: str,
    args: Sequence[str],
    version: str = DEFAULT_KAFKA_VERSION,
    timeout: float = 120.0,
    *,
    cache_dir: Path | str | None = None,
    input: str | None = None,
    check: bool = False,
    jvm_opts: Sequence[str] = TOOL_JVM_OPTS,
) -> subprocess.CompletedProcess[str]:
    """Run a Kafka CLI class (or a script name from :data:`KAFKA_TOOLS`) and capture its output.

    Example: ``run_kafka_tool("kafka-console-consumer", ["--bootstrap-server", bs, "--topic", "t",
    "--from-beginning", "--max-messages", "3"])``. Logging is reduced to errors on stderr, so stdout
    holds only the tool's own output. With *check* a non-zero exit raises ``CalledProcessError``.
    """
    main_class = KAFKA_TOOLS.get(main_class, main_class)
    lib = ensure_kafka_jars(version, cache_dir)
    cmd = java_command(main_class, args, lib=lib, log4j2_config=tools_log4j2_config(), jvm_opts=jvm_opts)
    return subprocess.run(
        cmd,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


# -- process / network helpers shared by LocalBroker and LocalCluster --------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on *host* right now.

    A *host* that is no address of this network namespace (a broker started in another one, reached
    over a veth) cannot be probed: then a port free on every local address is returned.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def new_cluster_id() -> str:
    """A random KRaft cluster id (22-char url-safe base64 UUID, like ``kafka-storage random-uuid``)."""
    while True:  # like Kafka's Uuid.randomUuid(): no leading "-", which CLI parsers take for an option
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def is_kafka_process(pid: int, marker: str) -> bool:
    """True if *pid* is a live (non-zombie) ``kafka.Kafka`` JVM with *marker* among its arguments.

    Guards every signal we send: a stale pid file must never make us kill an unrelated process.
    """
    if not Path("/proc/self").exists():  # no procfs (not Linux): best effort
        return pid_alive(pid)
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"kafka.Kafka" in argv and marker.encode() in argv and pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """True while any thread of *pid* is alive (not a zombie).

    The JVM's leader thread can turn zombie during shutdown while other threads still hold its sockets,
    so every task is checked; a process whose tasks are all zombies has closed its files.
    """
    if not Path("/proc/self").exists():  # no procfs (not Linux)
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        with contextlib.suppress(OSError, IndexError):
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
    return False


def wait_for_brokers(
    bootstrap: str, count: int, deadline: float, security: ClientSecurity | None = None
) -> dict[int, str]:
    """Poll metadata (confluent-kafka AdminClient) until *count* brokers are registered.

    *deadline* is a ``time.monotonic()`` value; *security* defaults to the process's
    (:func:`~dora_rl.infra.kafka.security.current`). Returns ``{node_id: "host:port"}``.
    """
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka.security import client_config

    admin = AdminClient(client_config(bootstrap, security=security, log_level=2))
    last: object = None
    while True:
        try:
            md = admin.list_topics(timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            brokers = {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()}
            if len(brokers) >= count:
                return brokers
            last = f"{len(brokers)} of {count} brokers registered: {brokers}"
        except Exception as exc:  # KafkaException and friends: retry until the deadline
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"metadata from {bootstrap} not ready in time: {last}")
        time.sleep(0.2)
