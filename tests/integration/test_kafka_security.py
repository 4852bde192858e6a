"""Kafka security against a REAL SASL_SSL broker started by ``LocalBroker(security=BrokerSecurity())``.

One module-scoped single-node broker (temporary dir, free ports; a broker that cannot start is a test
ERROR, never a skip). Users: ``alice`` granted the ``scorer`` role (writes ``dora.rollout.scored``, not
``dora.train.batches``), ``mallory`` with no ACL at all. Covered: round trips over SASL_SSL with
confluent-kafka and aiokafka; a wrong password failing fast with ``_AUTHENTICATION`` (raw client,
``RecordProducer``, and a ``dora-rl`` subprocess given its password by file); a missing WRITE ACL giving
``TOPIC_AUTHORIZATION_FAILED`` (raw client and ``RecordProducer``), no ACL failing ``RunConsumer``; no
password in the broker's log, argv, reprs or client logs. The last test (marked ``slow``, ~20 s) starts
a secured 3-node ``LocalCluster``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from dora_rl.infra.broker.cluster import LocalCluster
from dora_rl.infra.broker.server import BrokerError, BrokerSecurity, LocalBroker
from dora_rl.infra.kafka import security as ks
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, RecordProducer
from dora_rl.infra.kafka.topic_admin import ensure_topics
from dora_rl.schemas.records import Trajectory

pytestmark = pytest.mark.broker

ALICE_PW = f"alice-{uuid.uuid4().hex}"
MALLORY_PW = f"mallory-{uuid.uuid4().hex}"
WRONG_PW = f"wrong-{uuid.uuid4().hex}"
RUN = "r1"
"""The run alice is a scorer of; every topic of a run is its own (decision 0063)."""
SCORED, BATCHES = topics.in_run(RUN, topics.SCORED), topics.in_run(RUN, topics.BATCHES)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    b = LocalBroker(tmp_path_factory.mktemp("kafka-secure") / "broker", port=0, security=BrokerSecurity())
    b.start()
    try:
        for run in (RUN, "runA", "runB"):
            ensure_topics(AdminClient(ks.client_config(b.bootstrap_servers, security=b.client_security())), 2,
                                 run_id=run)
        admin = b.admin()
        admin.create_user("alice", ALICE_PW)
        admin.grant_role("User:alice", "scorer", run_id=RUN)
        admin.create_user("mallory", MALLORY_PW)
        yield b
    finally:
        b.stop()


def user(b: LocalBroker, name: str, password: str) -> ks.ClientSecurity:
    return ks.ClientSecurity("SASL_SSL", username=name, password=password, ca_file=b.secrets.ca_file)


def test_confluent_round_trip_over_sasl_ssl(broker: LocalBroker) -> None:
    alice = user(broker, "alice", ALICE_PW)
    p = Producer(ks.client_config(broker.bootstrap_servers, security=alice, **{"enable.idempotence": True}))
    key = uuid.uuid4().hex
    for i in range(5):
        p.produce(SCORED, f"v{i}".encode(), key.encode())
    assert p.flush(30) == 0
    c = Consumer(ks.client_config(broker.bootstrap_servers, security=alice, **{
        "group.id": f"dora.{RUN}.scorer.test.{key}", "auto.offset.reset": "earliest"}))
    c.subscribe([SCORED])
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < 5 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None:
                assert m.error() is None, m.error()
                if m.key() == key.encode():
                    got.append(m.value() or b"")
        c.commit(asynchronous=False)  # READ on the scorer's groups of its run: committing works
    finally:
        c.close()
    assert got == [f"v{i}".encode() for i in range(5)]


def test_aiokafka_round_trip_over_sasl_ssl(broker: LocalBroker) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    kwargs = ks.aiokafka_kwargs(user(broker, "alice", ALICE_PW))
    key = uuid.uuid4().hex.encode()

    async def main() -> list[bytes]:
        prod = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all", **kwargs)
        await prod.start()
        try:
            for i in range(3):
                await prod.send_and_wait(SCORED, f"a{i}".encode(), key=key)
        finally:
            await prod.stop()
        cons = AIOKafkaConsumer(SCORED, bootstrap_servers=broker.bootstrap_servers,
                                group_id=f"dora.{RUN}.scorer.aio.{key.decode()}", auto_offset_reset="earliest",
                                **kwargs)
        await cons.start()
        out: list[bytes] = []
        try:
            async with asyncio.timeout(30):
                async for m in cons:
                    if m.key == key:
                        out.append(m.value)
                    if len(out) == 3:
                        break
        finally:
            await cons.stop()
        return out

    assert asyncio.run(main()) == [b"a0", b"a1", b"a2"]
    creds = ks.faust_broker_credentials(user(broker, "alice", ALICE_PW))
    assert creds is not None and creds.ssl_context is not None and creds.mechanism.value == "SCRAM-SHA-512"


def test_wrong_password_fails_fast_with_authentication_error(broker: LocalBroker) -> None:
    bad = user(broker, "alice", WRONG_PW)
    errors: list[KafkaError] = []
    p = Producer(ks.client_config(broker.bootstrap_servers, security=bad, error_cb=errors.append))
    t0 = time.monotonic()
    while not any(e.code() == KafkaError._AUTHENTICATION for e in errors) and time.monotonic() - t0 < 30:
        p.poll(0.2)
    auth = [e for e in errors if e.code() == KafkaError._AUTHENTICATION]
    assert auth, f"no _AUTHENTICATION error within 30 s: {errors}"
    assert "authentication failed" in auth[0].str().lower()

    t0 = time.monotonic()
    with ks.using(bad), pytest.raises(ks.KafkaSecurityError) as exc:
        producer = RecordProducer(broker.bootstrap_servers, "wrong-password")
        producer.send_raw(SCORED, b"x", b"k")
        producer.flush(60)
    assert time.monotonic() - t0 < 30
    assert exc.value.code_name == "_AUTHENTICATION" and "_AUTHENTICATION" in str(exc.value)
    assert WRONG_PW not in str(exc.value)


def test_missing_write_acl_is_topic_authorization_failed(broker: LocalBroker) -> None:
    alice = user(broker, "alice", ALICE_PW)  # a scorer: may write dora.rollout.scored, not dora.train.batches
    reports: list[KafkaError | None] = []
    p = Producer(ks.client_config(broker.bootstrap_servers, security=alice))
    p.produce(BATCHES, b"x", on_delivery=lambda err, msg: reports.append(err))
    p.flush(30)
    assert reports and reports[0] is not None
    assert reports[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED == 29

    t0 = time.monotonic()
    with ks.using(alice), pytest.raises(ks.KafkaSecurityError) as exc:
        producer = RecordProducer(broker.bootstrap_servers, "scorer-without-acl")
        producer.send_raw(BATCHES, b"x", b"k")
        producer.flush(60)
    assert time.monotonic() - t0 < 30
    assert exc.value.code_name == "TOPIC_AUTHORIZATION_FAILED" and "TOPIC_AUTHORIZATION_FAILED" in str(exc.value)


def test_a_principal_of_one_run_cannot_commit_offsets_for_or_fence_another_runs_roles(broker: LocalBroker) -> None:
    """Granted for run A only (``grant_role(..., run_id)``): it reads run A's topics, its own group commits and its
    own transactional id initialises; the same for run B is refused by the broker (issue 32, decisions 0057,
    0063)."""
    name, pw = f"carol-{uuid.uuid4().hex[:6]}", f"pw-{uuid.uuid4().hex}"
    admin = broker.admin()
    admin.create_user(name, pw)
    admin.grant_role(f"User:{name}", "scorer", run_id="runA")
    carol = user(broker, name, pw)
    offsets = AdminClient(ks.client_config(broker.bootstrap_servers, security=carol))
    for run, allowed in (("runA", True), ("runB", False)):
        commit = offsets.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(f"dora.{run}.scorer", [TopicPartition(topics.in_run(run, topics.SCORED), 0,
                                                                                0)])])
        if allowed:
            [f.result(30) for f in commit.values()]
        else:
            with pytest.raises(KafkaException, match="GROUP_AUTHORIZATION_FAILED"):
                [f.result(30) for f in commit.values()]
        p = Producer(ks.client_config(broker.bootstrap_servers, security=carol,
                                      **{"transactional.id": f"dora.{run}.scorer"}))
        if allowed:
            p.init_transactions(30)
        else:
            with pytest.raises(KafkaException, match="TRANSACTIONAL_ID_AUTHORIZATION_FAILED"):
                p.init_transactions(30)
        assert _read_error(broker, carol, topics.in_run(run, topics.TRAJECTORIES)) == (
            None if allowed else "TOPIC_AUTHORIZATION_FAILED"), run


def _read_error(broker: LocalBroker, security: ks.ClientSecurity, topic: str) -> str | None:
    """The broker's refusal of reading ``topic`` as ``security`` (None: read to its end)."""
    errors: list[KafkaError] = []
    consumer = Consumer(ks.client_config(broker.bootstrap_servers, security=security, **{
        "group.id": f"dora-reader-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
        "enable.partition.eof": True, "auto.offset.reset": "earliest", "error_cb": errors.append}))
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if errors:
                return str(errors[0].name())
            for msg in consumer.consume(10, 0.5):
                if msg.error() is not None and msg.error().code() == KafkaError._PARTITION_EOF:
                    return None
                if msg.error() is not None:
                    return str(msg.error().name())
        raise AssertionError(f"reading {topic}: neither its end nor a refusal within 30 s")
    finally:
        consumer.close()


def test_consumer_without_acls_fails_fast(broker: LocalBroker) -> None:
    mallory = user(broker, "mallory", MALLORY_PW)
    with ks.using(mallory):
        letters = DeadLetters(RecordProducer(broker.bootstrap_servers, "mallory"), "test", "r1")
        consumer = RunConsumer(broker.bootstrap_servers, "r1", "scorer", {SCORED: Trajectory}, letters)
    t0 = time.monotonic()
    try:
        with pytest.raises(ks.KafkaSecurityError) as exc:
            while time.monotonic() - t0 < 30:
                consumer.poll(0.5)
    finally:
        consumer.raw.close()
    assert exc.value.code_name in ("TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED"), exc.value


def test_cli_role_with_wrong_password_exits_naming_the_code(broker: LocalBroker, tmp_path: Path) -> None:
    env = {**os.environ, **ks.child_env(user(broker, "alice", WRONG_PW), tmp_path / "secrets")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dora_rl", "runs", "--bootstrap-servers", broker.bootstrap_servers],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30
    assert "KafkaSecurityError" in proc.stderr and "_AUTHENTICATION" in proc.stderr, proc.stderr[-2000:]
    assert WRONG_PW not in proc.stderr + proc.stdout


def test_no_password_in_logs_argv_or_reprs(broker: LocalBroker, caplog: pytest.LogCaptureFixture) -> None:
    alice = user(broker, "alice", ALICE_PW)
    assert ALICE_PW not in repr(alice) and ALICE_PW not in str(alice)
    librdkafka = logging.getLogger("test.librdkafka")
    with caplog.at_level(logging.DEBUG):
        p = Producer(ks.client_config(broker.bootstrap_servers, security=alice, logger=librdkafka,
                                      debug="conf,security,broker"))
        p.produce(SCORED, b"x")
        p.flush(30)
        p.poll(0.5)
    assert "sasl" in caplog.text.lower() and "SCRAM" in caplog.text  # the debug log did talk about auth
    secrets = [ALICE_PW, MALLORY_PW, WRONG_PW, broker.secrets.admin_password, broker.secrets.controller_password]
    assert not [s for s in secrets if s in caplog.text]
    log_text = broker.log_file.read_text(errors="replace")
    assert "SASL_SSL" in log_text and not [s for s in secrets if s in log_text]
    argv = Path(f"/proc/{broker.pid}/cmdline").read_bytes().decode(errors="replace")
    assert not [s for s in secrets if s in argv]
    assert (broker.properties_file.stat().st_mode & 0o077) == 0  # holds the JAAS passwords: owner only
    status = repr(broker.status()) + repr(broker.secrets) + repr(broker.client_security())
    assert not [s for s in secrets if s in status]
    assert broker.secrets.admin_password not in broker.secrets.client_config_file.read_text()


def test_secured_start_refuses_storage_formatted_without_security(tmp_path: Path) -> None:
    (tmp_path / "b" / "kraft").mkdir(parents=True)
    (tmp_path / "b" / "kraft" / "meta.properties").write_text("cluster.id=abc\nnode.id=1\nversion=1\n")
    with pytest.raises(BrokerError, match="formatted without security"):
        LocalBroker(tmp_path / "b", port=0, security=BrokerSecurity()).start()


@pytest.mark.slow
def test_secured_three_node_cluster(tmp_path: Path) -> None:
    """SLOW (~25 s on 2 cores): 3 nodes, inter-broker SCRAM over TLS, controllers over TLS + PLAIN."""
    from confluent_kafka.admin import NewTopic

    with LocalCluster(tmp_path / "cluster", security=BrokerSecurity(), heap="384m") as cluster:
        admin_sec = cluster.client_security()
        admin = AdminClient(ks.client_config(cluster.bootstrap_servers, security=admin_sec))
        for fut in admin.create_topics([NewTopic(t, 3, 3) for t in (SCORED, BATCHES)]).values():
            fut.result(timeout=30)
        sec_admin = cluster.admin()
        sec_admin.create_user("alice", ALICE_PW)
        sec_admin.grant_role("alice", "scorer", run_id=RUN)
        alice = ks.ClientSecurity("SASL_SSL", username="alice", password=ALICE_PW,
                                  ca_file=cluster.nodes[0].secrets.ca_file)
        with ks.using(alice):
            producer = RecordProducer(cluster.bootstrap_servers, "cluster-alice")
            for i in range(6):
                producer.send_raw(SCORED, f"c{i}".encode(), f"k{i}".encode())
            producer.flush(60)
            with pytest.raises(ks.KafkaSecurityError, match="TOPIC_AUTHORIZATION_FAILED"):
                producer.send_raw(BATCHES, b"x", b"k")  # not a scorer's topic
                producer.flush(60)
        md = admin.list_topics(SCORED, timeout=10).topics[SCORED]
        assert all(len(p.replicas) == 3 and len(p.isrs) == 3 for p in md.partitions.values())
