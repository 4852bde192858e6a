"""Shared fixtures. Broker tests start a real Kafka broker; they never skip (in CI or locally):
a broker that cannot start is a test error. ``DORA_TEST_BOOTSTRAP`` points them at an existing
cluster instead."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from run_processes import leftover_run_processes

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def dora_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An isolated ``$DORA_HOME`` (models, runs) sharing the Kafka jar cache of the real one."""
    from dora_rl.infra.broker.dist import dora_home as real_home

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


@pytest.fixture(autouse=True)
def _reap_leftover_run_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After each test, SIGKILL the run processes it left alive and say so. A test stopped by its timeout
    SIGKILLs the launcher it started, whose roles (in sessions of their own) would otherwise run on and slow
    every later test."""
    yield
    left = leftover_run_processes(tmp_path_factory.getbasetemp())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        warnings.warn(f"killed {len(left)} run process(es) the test left alive: {left}", stacklevel=1)


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real broker (started here, on free ports) with the topic catalogue."""
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.infra.kafka.topic_admin import ensure_topics

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


# -- CI budget: time per tier ----------------------------------------------------------------------

CI_BUDGET_S = 25 * 60
"""The whole suite (lint, the integration tier and the unit tier, each a pytest session of ``make test``) must stay
under 25 minutes on the project machine (2 cores)."""

_tier_s: dict[str, float] = defaultdict(float)
_tier_n: dict[str, int] = defaultdict(int)
_test_s: dict[str, float] = defaultdict(float)
_session_start = time.monotonic()


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _tier_s[_tier(report.nodeid)] += report.duration
    _test_s[report.nodeid] += report.duration
    if report.when == "call":
        _tier_n[_tier(report.nodeid)] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per tier (setup + call + teardown of its tests, summed), and the session's wall time against the CI
    budget."""
    wall = time.monotonic() - _session_start
    tr = terminalreporter
    tr.section("CI budget: duration per tier")
    workers = getattr(tr.config.option, "numprocesses", None)
    parallel = f" (on {workers} xdist workers at once: more than the wall time)" if workers else ""
    for tier in sorted(_tier_s):
        tr.write_line(f"tier {tier}: {_tier_s[tier]:.0f} s summed over its {_tier_n[tier]} tests{parallel}")
    tr.write_line(f"pytest wall time {wall:.0f} s of the {CI_BUDGET_S // 60}-minute budget "
                  f"({100 * wall / CI_BUDGET_S:.0f}%; lint is timed by make as 'tier lint')")
    slowest = sorted(_test_s.items(), key=lambda kv: -kv[1])[:15]
    tr.write_line("slowest tests (setup + call + teardown):")
    for nodeid, seconds in slowest:
        tr.write_line(f"  {seconds:6.0f} s  {nodeid}")
    _write_durations(Path(str(tr.config.rootpath)) / "build" / "test-durations.json")


def _write_durations(path: Path) -> None:
    """Every test's seconds, slowest first, for trimming the suite to its budget (``build/`` is not committed).
    Merged into what an earlier session wrote there, so a run of a few tests updates only theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    seconds = json.loads(path.read_text()) if path.is_file() else {}
    seconds.update((k, round(v, 1)) for k, v in _test_s.items())
    ranked = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    path.write_text(json.dumps(ranked, indent=1) + "\n")
