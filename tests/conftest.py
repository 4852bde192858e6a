"""Shared fixtures. Broker tests start a real Kafka broker; they never skip (in CI or locally):
a broker that cannot start is a test error. ``DORA_TEST_BOOTSTRAP`` points them at an existing
cluster instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def dora_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An isolated ``$DORA_HOME`` (models, runs) sharing the Kafka jar cache of the real one."""
    from dora_rl.infra.kafka_dist import dora_home as real_home

    home = tmp_path_factory.mktemp("dora_home")
    jars = real_home() / "kafka"
    jars.mkdir(parents=True, exist_ok=True)
    (home / "kafka").symlink_to(jars, target_is_directory=True)
    old = os.environ.get("DORA_HOME")
    os.environ["DORA_HOME"] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("DORA_HOME", None)
        else:
            os.environ["DORA_HOME"] = old


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real broker (started here, on free ports) with the topic catalogue."""
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.broker import LocalBroker
    from dora_rl.infra.topics import ensure_topics

    given = os.environ.get("DORA_TEST_BOOTSTRAP")
    broker = None
    if given:
        servers = given
    else:
        broker = LocalBroker(tmp_path_factory.mktemp("kafka-session") / "broker", port=0)
        broker.start()
        servers = broker.bootstrap_servers
    ensure_topics(AdminClient({"bootstrap.servers": servers}), 4)
    try:
        yield servers
    finally:
        if broker is not None:
            broker.stop()
