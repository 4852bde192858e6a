"""The Kafka clients report to one observer (infra/kafka/events.py); the metrics endpoint registers prom."""

from __future__ import annotations

from typing import Any

import pytest

from dora_rl.infra.kafka import events, topics
from dora_rl.infra.kafka.lag import LagProbe
from dora_rl.infra.observability import prom
from dora_rl.schemas.records import DeadLetter


class Closable:
    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def no_observer() -> Any:
    events.report_to(None)
    yield
    events.report_to(None)


def counted(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_with_no_observer_nothing_is_counted_and_a_consumer_is_just_closed() -> None:
    before = counted("dora_records_sent_total", topic="t-none")
    events.sent("t-none", object())
    c = Closable()
    events.consumer_opened(c, LagProbe("g"), "b")
    events.consumer_closing(c)
    assert c.closed and counted("dora_records_sent_total", topic="t-none") == before


def test_prom_observes_once_registered_and_closes_what_it_watched() -> None:
    events.report_to(prom)
    sent, letters = counted("dora_records_sent_total", topic=topics.DLQ), \
        counted("dora_dead_letters_total", component="c", error_type="e")
    events.sent(topics.DLQ, DeadLetter(component="c", reason="r", error_type="e", source_topic="t",
                                       source_partition=0, source_offset=0, ts_ms=0, run_id="r"))
    events.dead_lettered("c", "e")
    assert counted("dora_records_sent_total", topic=topics.DLQ) == sent + 2
    assert counted("dora_dead_letters_total", component="c", error_type="e") == letters + 2
    c = Closable()
    events.consumer_opened(c, LagProbe("g"), "b")
    assert id(c) in prom.STATE.consumers.consumers
    events.consumer_closing(c)
    assert c.closed and id(c) not in prom.STATE.consumers.consumers
