"""The ``/metrics`` endpoint of a role process (the families are :mod:`dora_rl.infra.observability.prom`).

Configuration comes from the process's environment (a fact of its host, like
:mod:`dora_rl.infra.endpoints`):

- ``DORA_METRICS=off`` (or ``0``, ``false``, ``no``): no endpoint;
- ``DORA_METRICS_PORT``: the port; unset or ``0`` picks a free one. A fixed port already taken (two
  roles on one host with the same setting) falls back to a free one with a warning: monitoring never
  stops a role;
- the bind address is ``Endpoints.from_env().bind_host`` (``DORA_BIND_HOST``) and the announced one
  ``Endpoints.advertised`` (``DORA_ADVERTISED_HOST``).

Announcement (the endpoint is discoverable without knowing the port in advance):

1. a log line ``metrics endpoint of <name>: http://<host:port>/metrics``;
2. a ``Metric`` record on ``dora.metrics`` (component ``<name>``, name ``metrics_endpoint``, value the
   port, labels ``address``, ``url``, ``role``): how tools on other hosts find every endpoint of a run;
3. the file ``$DORA_HOME/metrics-endpoints/<run>.<name>.json``, in Prometheus ``file_sd`` format
   (``[{"targets": ["host:port"], "labels": {...}}]``): one flat directory, so a Prometheus on the host
   scrapes every role of every run with one glob in the last path segment (the only place ``file_sd``
   allows one; ``infra/observability/grafana/prometheus.yml``). The file is removed when the process exits normally.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dora_rl.infra.endpoints import Endpoints

log = logging.getLogger(__name__)
METRICS_ENV, PORT_ENV = "DORA_METRICS", "DORA_METRICS_PORT"
_OFF = ("off", "0", "false", "no")


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where a role's ``/metrics`` is served and announced."""

    name: str
    """The process's name in its run: ``trainer``, ``rollout-3``, ``scorer``, …"""
    role: str
    run_id: str
    bind_host: str
    port: int
    advertised_host: str

    @property
    def address(self) -> str:
        """``host:port`` as announced (IPv6 hosts in brackets)."""
        host = self.advertised_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def file_sd(self) -> list[dict[str, object]]:
        """The Prometheus ``file_sd`` entry of this endpoint."""
        return [{"targets": [self.address], "labels": {"job": "dora", "run_id": self.run_id, "role": self.role,
                                                        "dora_name": self.name, "host": socket.gethostname()}}]


def enabled(env: dict[str, str] | None = None) -> bool:
    """False when ``DORA_METRICS`` turns the endpoint off."""
    env = dict(os.environ) if env is None else env
    return env.get(METRICS_ENV, "on").strip().lower() not in _OFF


def requested_port(env: dict[str, str] | None = None) -> int:
    """``DORA_METRICS_PORT`` (0 when unset: a free port)."""
    env = dict(os.environ) if env is None else env
    raw = env.get(PORT_ENV, "").strip() or "0"
    port = int(raw)
    if not 0 <= port < 65536:
        raise ValueError(f"{PORT_ENV}={raw!r} is not a port")
    return port


def endpoints_dir() -> Path:
    """``$DORA_HOME/metrics-endpoints``: every endpoint file of every run on this host."""
    from dora_rl.infra.broker.dist import dora_home

    return dora_home() / "metrics-endpoints"


def endpoint_file(run_id: str, name: str) -> Path:
    """The ``file_sd`` file of role ``name`` of run ``run_id``."""
    return endpoints_dir() / f"{run_id}.{name}.json"


def serve(bootstrap: str, run_id: str, role: str, name: str) -> MetricsEndpoint | None:
    """Serve this process's ``/metrics`` and announce it (see the module docstring); None when off."""
    if not enabled():
        log.info("metrics endpoint off (%s)", METRICS_ENV)
        return None
    from prometheus_client import start_http_server

    from dora_rl.infra.kafka import events
    from dora_rl.infra.observability import prom

    prom.role_info(run_id, role, name)
    events.report_to(prom)  # the Kafka clients' counts and consumers, from now on
    ep = Endpoints.from_env()
    port = requested_port()
    try:
        server, _ = start_http_server(port, addr=ep.bind_host)
    except OSError as exc:
        if port == 0:
            raise
        log.warning("%s=%d: %s; serving metrics on a free port instead", PORT_ENV, port, exc)
        server, _ = start_http_server(0, addr=ep.bind_host)
    endpoint = MetricsEndpoint(name, role, run_id, ep.bind_host, int(server.server_port), ep.advertised)
    log.info("metrics endpoint of %s: %s", name, endpoint.url)
    _write_file(endpoint)
    _announce(bootstrap, endpoint)
    return endpoint


def _write_file(endpoint: MetricsEndpoint) -> None:
    path = endpoint_file(endpoint.run_id, endpoint.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(endpoint.file_sd(), indent=1))
    tmp.replace(path)  # a Prometheus reading the glob never sees half a file
    pid = os.getpid()

    def remove() -> None:
        with contextlib.suppress(OSError):
            if os.getpid() == pid and json.loads(path.read_text()) == endpoint.file_sd():
                path.unlink()

    atexit.register(remove)


def _announce(bootstrap: str, endpoint: MetricsEndpoint) -> None:
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import RecordProducer, now_ms
    from dora_rl.schemas.records import Metric

    try:
        producer = RecordProducer(bootstrap, f"{endpoint.name}-metrics-{endpoint.run_id}")
        producer.send(topics.in_run(endpoint.run_id, topics.METRICS), Metric(
            run_id=endpoint.run_id, component=endpoint.name, name="metrics_endpoint", value=float(endpoint.port),
            ts_ms=now_ms(), labels={"address": endpoint.address, "url": endpoint.url, "role": endpoint.role}),
            f"{endpoint.name}/metrics_endpoint")
        producer.flush(10)
    except Exception as exc:  # the file and the log line still say where it is
        log.warning("metrics endpoint of %s not announced on %s: %s", endpoint.name, "dora.metrics", exc)


__all__ = ["METRICS_ENV", "PORT_ENV", "MetricsEndpoint", "enabled", "endpoint_file", "endpoints_dir", "requested_port",
           "serve"]
