"""What this process's Kafka clients report as they work, to the one observer registered (decision 0058).

The clients of :mod:`dora_rl.infra.kafka.io` call :func:`sent`, :func:`dead_lettered`,
:func:`consumer_opened` and :func:`consumer_closing`. An observer registered with :func:`report_to`
receives them: the metrics endpoint registers :mod:`dora_rl.infra.observability.prom` when it starts
serving. So the Kafka package never imports observability; observability sits above it.

Invariants: with no observer nothing is recorded and a closing consumer is simply closed; with one, the
observer closes it (after it stopped reading its lag). An observer never raises into a client (``prom``'s
hooks log and swallow their own failures).
"""

from __future__ import annotations

from typing import Any, Protocol

from dora_rl.infra.kafka.lag import LagProbe


class ClientObserver(Protocol):
    """Receives what the clients do (``prom`` implements it as module functions)."""

    def record_sent(self, topic: str, record: Any) -> None: ...

    def dead_letter(self, component: str, error_type: str) -> None: ...

    def watch_consumer(self, consumer: Any, probe: LagProbe, bootstrap: str) -> None: ...

    def release_consumer(self, consumer: Any) -> None: ...


_observer: list[ClientObserver] = []


def report_to(observer: ClientObserver | None) -> None:
    """Send this process's client events to ``observer`` from now on (None: to no one)."""
    _observer[:] = [] if observer is None else [observer]


def sent(topic: str, record: Any) -> None:
    for o in _observer:
        o.record_sent(topic, record)


def dead_lettered(component: str, error_type: str) -> None:
    for o in _observer:
        o.dead_letter(component, error_type)


def consumer_opened(consumer: Any, probe: LagProbe, bootstrap: str) -> None:
    """``consumer`` is open; its owner records its lag in ``probe`` after each poll."""
    for o in _observer:
        o.watch_consumer(consumer, probe, bootstrap)


def consumer_closing(consumer: Any) -> None:
    """Close ``consumer``: through the observer, which first stops reading it, if there is one."""
    if _observer:
        _observer[0].release_consumer(consumer)
    else:
        consumer.close()
