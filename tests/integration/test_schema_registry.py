"""The optional Confluent wire format against a real Apicurio Registry and a real broker.

Records written by :class:`dora_rl.schemas.registry.ConfluentCodec` go through Kafka and are read back
by confluent-kafka's standard ``AvroDeserializer`` (the registry's schema, no reader schema of ours) and
by the codec itself; the body after the 5-byte prefix is exactly the default schemaless value.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import numpy as np
import pytest
from apicurio import Apicurio, ensure_apicurio

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore:The httpx module is deprecated")]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apicurio]:
    from dora_rl.infra.broker.dist import dora_home, free_port

    server = Apicurio(ensure_apicurio(dora_home() / "apicurio"), free_port(),
                      tmp_path_factory.mktemp("apicurio") / "registry.log")
    try:
        print(f"Apicurio ready in {server.wait_ready():.1f}s")
        yield server
    finally:
        server.stop()


def _records() -> list:
    from dora_rl.schemas.records import Metric, TrainBatch, Trajectory

    t = Trajectory(run_id="r", trajectory_id="r/p1/0", group_id="r/p1", prompt_id="p1", sample_index=0,
                   group_size=4, policy_version=3, task="reverse", reference="cba",
                   prompt_ids=np.arange(4, dtype="<i4"), response_ids=np.arange(3, dtype="<i4"),
                   behaviour_logprobs=np.full(3, -0.5, dtype="<f4"), response_text="cba", finish_reason="STOP",
                   reward=1.0, scored_ms=7)
    b = TrainBatch(run_id="r", batch_id="r/step0", train_step=0, base_version=3, max_staleness=1, created_ms=1,
                   trajectories=(t, t.replace(trajectory_id="r/p1/1", sample_index=1, reward=0.25)))
    m = Metric(run_id="r", component="trainer", name="reward_mean", value=0.5, ts_ms=3, step=0)
    return [t, b, m]


def test_confluent_framed_records_read_back_by_avro_deserializer(registry: Apicurio, bootstrap: str) -> None:
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from dora_rl.infra.kafka.io import RecordProducer, read_range, reader_config
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.registry import ConfluentCodec, SchemaRegistry, is_confluent

    topic = f"test.registry.{secrets.token_hex(3)}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    codec = ConfluentCodec(SchemaRegistry(registry.ccompat))
    records = _records()
    producer = RecordProducer(bootstrap, "registry-test")
    for rec in records:
        value, headers = codec.encode(topic, rec)
        assert value[0] == 0 and value[5:] == rec.encode()[0]  # the schemaless body, framed
        assert is_confluent(headers) and not is_confluent(rec.encode()[1])
        producer.send_raw(topic, value, rec.SCHEMA.encode(), headers)
    producer.flush()

    consumer = Consumer(reader_config(bootstrap, "registry-test"))
    try:
        msgs = list(read_range(consumer, TopicPartition(topic, 0), 0, len(records), 30))
    finally:
        consumer.close()
    deserializer = AvroDeserializer(SchemaRegistryClient({"url": registry.ccompat}))
    ctx = SerializationContext(topic, MessageField.VALUE)
    for rec, msg in zip(records, msgs, strict=True):
        assert deserializer(msg.value(), ctx) == rec.to_avro()  # confluent-kafka's own reader
        assert type(rec).from_avro(codec.decode_datum(rec.SCHEMA, msg.value())).to_avro() == rec.to_avro()
    # every record type registers and frames (nested named types are expanded for the registry)
    fresh = ConfluentCodec(SchemaRegistry(registry.ccompat))
    assert fresh.decode(type(records[1]), msgs[1].value()).trajectories[1].reward == 0.25
    with pytest.raises(DecodeError) as bad:
        fresh.decode_datum("dora.v1.Metric", b"\x00\x7f\xff\xff\xf0" + records[2].encode()[0])
    assert bad.value.error_type == "schema"
    with pytest.raises(DecodeError):
        fresh.decode_datum("dora.v1.Metric", records[2].encode()[0])  # schemaless is not framed


def test_every_current_schema_registers(registry: Apicurio) -> None:
    from dora_rl.schemas import codec
    from dora_rl.schemas.registry import SchemaRegistry, registry_schema

    client = SchemaRegistry(registry.ccompat)
    ids = {name: client.register(f"test.{name}-value", registry_schema(name)) for name in codec.current_schemas()}
    assert len(set(ids.values())) == len(ids)
    assert all(json.loads(client.schema(i))["name"] == name for name, i in ids.items())
