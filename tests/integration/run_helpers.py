"""Helpers shared by the integration tests that follow a live run (tests/integration is on sys.path)."""

from __future__ import annotations

import time
from typing import Any


def steps_done(bootstrap: str, run_id: str) -> int:
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run, offsets_map
    from dora_rl.schemas.records import Metric

    start = {p: o for (t, p), o in offsets_map(get_run(bootstrap, run_id)).items() if t == topics.METRICS}
    steps = set()
    for msg in read_all(bootstrap, topics.METRICS, start):
        m = Metric.decode(msg.value(), msg.headers())
        if m.run_id == run_id and m.component == "trainer" and m.name == "reward_mean" and m.step is not None:
            steps.add(int(m.step))
    return len(steps)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)
