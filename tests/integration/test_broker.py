"""Integration tests against a REAL Apache Kafka broker started by ``dora_rl.infra.broker.server``.

The fixtures start their own brokers (free ports, temp data dirs), so a broker that cannot start is a
test ERROR, never a skip. Covered: confluent-kafka, aiokafka and faust-streaming against the broker,
transactions, the broker's own CLI tools, restart durability, and a 3-node cluster losing its leader.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from dora_rl.infra.broker.cluster import LocalCluster
from dora_rl.infra.broker.server import (
    JVM_OPTS_ENV,
    LocalBroker,
    broker_status,
    resolve_bootstrap,
    run_kafka_tool,
    stop_broker,
)
from dora_rl.infra.kafka.read import consume_ready

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    b = LocalBroker(tmp_path_factory.mktemp("kafka") / "broker", port=0)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def new_topic(bootstrap: str, partitions: int = 1, rf: int = 1, **config: str) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, rf, config=config)])[name].result(timeout=30)
    return name


def consume(
    bootstrap: str, topic: str, n: int, timeout: float = 30.0, **conf: object
) -> list[tuple[str, bytes]]:
    """Read up to *n* records from the beginning with a fresh group; returns (key, value) pairs."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **conf,
        }
    )
    c.subscribe([topic])
    out: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            assert m.error() is None, m.error()
            out.append(((m.key() or b"").decode(), m.value() or b""))
    finally:
        c.close()
    return out


def test_resolve_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DORA_BOOTSTRAP_SERVERS", raising=False)
    assert resolve_bootstrap(None) is None
    monkeypatch.setenv("DORA_BOOTSTRAP_SERVERS", "h:1")
    assert resolve_bootstrap(None) == "h:1"
    assert resolve_bootstrap("cli:2") == "cli:2"


def test_status_attach_and_idempotent_start(broker: LocalBroker) -> None:
    st = broker_status(broker.data_dir)
    assert st["running"] and st["pid"] == broker.pid and st["bootstrap_servers"] == broker.bootstrap_servers
    again = LocalBroker(broker.data_dir, port=0).start()  # same data dir: adopts the running broker
    assert again.pid == broker.pid and again.bootstrap_servers == broker.bootstrap_servers
    assert LocalBroker.attach(broker.data_dir).is_running()


def test_confluent_roundtrip_and_big_record(broker: LocalBroker) -> None:
    topic = new_topic(broker.bootstrap_servers, partitions=3)
    p = Producer({"bootstrap.servers": broker.bootstrap_servers, "message.max.bytes": 33554432})
    for i in range(100):
        p.produce(topic, key=f"k{i}", value=f"v{i}".encode())
    big = b"x" * (20 * 1024 * 1024)  # 20 MiB: needs the raised message.max.bytes
    p.produce(topic, key="big", value=big)
    assert p.flush(30) == 0
    got = dict(consume(broker.bootstrap_servers, topic, 101, **{"fetch.max.bytes": 67108864}))
    assert len(got) == 101 and got["k42"] == b"v42" and got["big"] == big


def test_auto_create_disabled(broker: LocalBroker) -> None:
    c = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": "probe"})
    try:
        md = c.list_topics("no-such-topic-typo", timeout=10)
    finally:
        c.close()
    assert md.topics["no-such-topic-typo"].error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART


def test_aiokafka_roundtrip(broker: LocalBroker) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = new_topic(broker.bootstrap_servers, partitions=2)

    async def run() -> list[bytes]:
        prod = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all")
        await prod.start()
        try:
            for i in range(50):
                await prod.send_and_wait(topic, f"a{i}".encode(), key=b"k%d" % (i % 5))
        finally:
            await prod.stop()
        cons = AIOKafkaConsumer(
            topic,
            bootstrap_servers=broker.bootstrap_servers,
            group_id=f"g-{uuid.uuid4().hex[:8]}",
            auto_offset_reset="earliest",
        )
        await cons.start()
        out: list[bytes] = []
        try:
            async with asyncio.timeout(30):
                async for msg in cons:
                    out.append(msg.value)
                    if len(out) == 50:
                        break
            await cons.commit()
        finally:
            await cons.stop()
        return out

    got = asyncio.run(run())
    assert sorted(got) == sorted(f"a{i}".encode() for i in range(50))


def test_faust_agent_and_table_end_to_end(broker: LocalBroker) -> None:
    """faust-streaming 0.15.3 + aiokafka 0.14 against this Kafka: agent, table, internal topics."""
    import faust

    bs = broker.bootstrap_servers
    src, dst = new_topic(bs, partitions=2), new_topic(bs, partitions=2)
    app_id = f"faust-{uuid.uuid4().hex[:8]}"
    app = faust.App(app_id, broker=f"kafka://{bs}", store="memory://", topic_partitions=2, web_enabled=False)
    in_topic = app.topic(src, key_type=str, value_type=bytes, value_serializer="raw")
    out_topic = app.topic(dst, key_type=str, value_type=bytes, value_serializer="raw")
    counts = app.Table("counts", default=int)

    @app.agent(in_topic)
    async def upper(stream):  # type: ignore[no-untyped-def]
        async for key, value in stream.items():
            counts[key] += 1
            await out_topic.send(key=key, value=value.upper())

    async def run() -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        await app.start()
        try:
            p = Producer({"bootstrap.servers": bs})
            for i in range(40):
                p.produce(src, key=f"k{i % 4}", value=f"v{i}".encode())
            assert p.flush(30) == 0
            out = await asyncio.to_thread(consume, bs, dst, 40, 90.0)
            table = dict(counts.items())
        finally:
            await app.stop()
        return out, table

    out, table = asyncio.run(run())
    assert sorted(v for _, v in out) == sorted(f"V{i}".encode() for i in range(40))
    assert table == {"k0": 10, "k1": 10, "k2": 10, "k3": 10}
    topics = AdminClient({"bootstrap.servers": bs}).list_topics(timeout=10).topics
    # created by faust itself through CreateTopics (auto.create.topics.enable=false on the broker)
    assert f"{app_id}-counts-changelog" in topics


def test_consume_ready_returns_when_the_first_record_comes_not_at_the_timeout(broker: LocalBroker) -> None:
    """A rollout instance's request (and the like) is taken when it arrives: ``consume(500, t)`` alone would wait
    the whole ``t`` for 500 records, holding a request that came meanwhile (librdkafka's batch consume)."""
    bs = broker.bootstrap_servers
    topic = new_topic(bs)
    c = Consumer({"bootstrap.servers": bs, "group.id": f"g-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    p = Producer({"bootstrap.servers": bs})
    try:
        p.produce(topic, key="warm", value=b"0")
        p.flush(30)
        assert [m.key() for m in consume_ready(c, 500, 30.0)] == [b"warm"]  # assigned and fetching
        producing = threading.Timer(0.5, lambda: (p.produce(topic, key="late", value=b"1"), p.flush(30)))
        producing.start()
        t0 = time.monotonic()
        got = consume_ready(c, 500, 20.0)
        waited = time.monotonic() - t0
        producing.join()
        assert [m.key() for m in got] == [b"late"]
        assert waited < 10.0, f"waited {waited:.1f} s for one record with a 20 s timeout"
        for i in range(3):
            p.produce(topic, key=f"k{i}", value=b"2")
        p.flush(30)
        assert len(consume_ready(c, 1, 30.0)) == 1  # never more than max_records
    finally:
        c.close()


def test_transactions_read_committed(broker: LocalBroker) -> None:
    bs = broker.bootstrap_servers
    topic = new_topic(bs)
    p = Producer({"bootstrap.servers": bs, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    p.init_transactions(30)
    for batch, commit in (("a", True), ("b", False), ("c", True)):
        p.begin_transaction()
        for i in range(5):
            p.produce(topic, key=f"{batch}{i}", value=batch.encode())
        if commit:
            p.commit_transaction(30)
        else:
            p.flush(30)
            p.abort_transaction(30)
    everything = consume(bs, topic, 15, **{"isolation.level": "read_uncommitted"})
    # the aborted batch "b" is in the log, but read_committed hides it
    assert [k for k, _ in everything] == [f"{b}{i}" for b in "abc" for i in range(5)]
    committed = consume(bs, topic, 10, **{"isolation.level": "read_committed"})
    assert [k for k, _ in committed] == [f"{b}{i}" for b in "ac" for i in range(5)]


def test_console_consumer_reads_python_records(broker: LocalBroker) -> None:
    bs = broker.bootstrap_servers
    topic = new_topic(bs)
    p = Producer({"bootstrap.servers": bs})
    for i in range(5):
        p.produce(topic, key=f"k{i}", value=f"hello-{i}".encode())
    assert p.flush(30) == 0
    args = ["--bootstrap-server", bs, "--topic", topic, "--from-beginning", "--max-messages", "5"]
    args += ["--timeout-ms", "30000", "--formatter-property", "print.key=true"]
    res = run_kafka_tool("org.apache.kafka.tools.consumer.ConsoleConsumer", args, timeout=90)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"k{i}\thello-{i}" for i in range(5)]
    listed = run_kafka_tool("kafka-topics", ["--bootstrap-server", bs, "--list"], check=True)
    assert topic in listed.stdout.split()


def jvm_args(pid: int | None) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_restart_keeps_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = LocalBroker(tmp_path / "broker", port=0).start()
    try:
        assert not any(a.startswith("-XX:TieredStopAtLevel") for a in jvm_args(b.pid))  # C2 on (decision 0038)
        bs = b.bootstrap_servers
        topic = new_topic(bs, partitions=2)
        p = Producer({"bootstrap.servers": bs})
        for i in range(30):
            p.produce(topic, key=f"k{i}", value=f"v{i}".encode())
        assert p.flush(30) == 0
        cluster_id, pid = b.cluster_id, b.pid
        assert stop_broker(b.data_dir) and not b.is_running()
        assert not broker_status(b.data_dir)["running"]
        monkeypatch.setenv(JVM_OPTS_ENV, "-XX:TieredStopAtLevel=1 -Ddora.test=restarted")
        b.start()  # same object, same ports; storage is not formatted again
        assert b.is_running() and b.pid != pid and b.cluster_id == cluster_id
        args = jvm_args(b.pid)  # the user's options come after the shipped ones (a later flag wins)
        assert args.index("-XX:TieredStopAtLevel=1") > args.index("-XX:+UseSerialGC")
        assert args.index("-Ddora.test=restarted") < args.index("kafka.Kafka")
        got = consume(b.bootstrap_servers, topic, 30)
        assert sorted(k for k, _ in got) == sorted(f"k{i}" for i in range(30))
    finally:
        b.stop()


@pytest.mark.slow
def test_cluster_survives_leader_kill(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster") as cluster:
        bs = cluster.bootstrap_servers
        topic = new_topic(bs, partitions=3, rf=3)
        acked: set[str] = set()
        failed: list[str] = []

        def on_delivery(err: KafkaError | None, msg: object) -> None:
            key = msg.key().decode()  # type: ignore[attr-defined]
            (failed.append(f"{key}: {err}") if err else acked.add(key))

        p = Producer(
            {
                "bootstrap.servers": bs,
                "acks": "all",
                "enable.idempotence": True,
                "delivery.timeout.ms": 180000,
                "request.timeout.ms": 30000,
                "linger.ms": 5,
            }
        )

        def produce(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                p.produce(topic, key=f"k{i}", value=f"v{i}".encode(), on_delivery=on_delivery)
                p.poll(0)
                time.sleep(0.002)

        produce(0, 300)
        assert p.flush(60) == 0 and len(acked) == 300
        md = AdminClient({"bootstrap.servers": bs}).list_topics(topic, timeout=10)
        leader = cluster.node_index(md.topics[topic].partitions[0].leader)
        cluster.kill_node(leader)
        assert not cluster.nodes[leader].is_running()
        produce(300, 600)  # 2 of 3 replicas left = min.insync.replicas: acks=all writes must go on
        assert p.flush(120) == 0 and len(acked) == 600, failed[:5]
        cluster.restart_node(leader)
        produce(600, 700)
        assert p.flush(60) == 0
        assert not failed, failed[:5]
        got = {k for k, _ in consume(bs, topic, len(acked), timeout=60)}
        assert acked - got == set(), f"acknowledged but missing: {sorted(acked - got)[:10]}"
        assert len(acked) == 700
