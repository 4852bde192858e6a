"""Feeds a :class:`~.monitor_view.RunView` from a run's topics (the I/O of ``monitor`` and ``dashboard``).

Reads, from the run's start offsets, with its own throw-away consumer group
``dora.<run>.<tool>.<ms>`` that never commits: ``dora.metrics``, ``dora.instances``, ``dora.dlq``,
``dora.policy.versions``, ``dora.train.batches``, ``dora.rollout.requests`` and
``dora.rollout.trajectories``. Every ``lag_every_s`` it refreshes the consumer lag of the run's roles
from their groups' committed offsets (:func:`dora_rl.infra.kafka.lag.committed_lag`) and the run's state from
``dora.runs``. A failure of those refreshes is logged and leaves the previous values shown.
"""

from __future__ import annotations

import logging
import threading
import time

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, RecordProducer, now_ms
from dora_rl.infra.kafka.lag import committed_lag, for_run_state
from dora_rl.infra.kafka.runs import get_run, offsets_map
from dora_rl.schemas.records import (
    DeadLetter,
    InstanceStatus,
    Metric,
    PolicyVersion,
    Record,
    RolloutRequest,
    TrainBatch,
    Trajectory,
)

from .monitor_view import RunView

log = logging.getLogger(__name__)
FEED_TOPICS: dict[str, type[Record]] = {
    topics.METRICS: Metric, topics.INSTANCES: InstanceStatus, topics.DLQ: DeadLetter,
    topics.VERSIONS: PolicyVersion, topics.BATCHES: TrainBatch, topics.REQUESTS: RolloutRequest,
    topics.TRAJECTORIES: Trajectory}


class RunFeed:
    """A run's records into a :class:`RunView` (see the module docstring)."""

    def __init__(self, bootstrap: str, run_id: str | None, tool: str = "monitor", lag_every_s: float = 5.0,
                 record_types: dict[str, type[Record]] | None = None) -> None:
        self.bootstrap = bootstrap
        info = get_run(bootstrap, run_id)
        config = DoraConfig.from_json(info.config_json)
        self.view = RunView(run_id=info.run_id, mode=info.mode, state=info.state,
                            max_staleness=config.max_staleness, steps_target=config.steps)
        producer = RecordProducer(bootstrap, tool)
        self.consumer = RunConsumer(bootstrap, info.run_id, tool, record_types or FEED_TOPICS,
                                    DeadLetters(producer, tool, info.run_id), offsets_map(info),
                                    group_suffix=f".{tool}.{now_ms()}")
        self.lag_every_s = lag_every_s
        self._refreshed = 0.0
        self.lock = threading.Lock()
        """Held while the view changes: a reader in another thread (the dashboard) snapshots under it."""

    @property
    def run_id(self) -> str:
        return self.view.run_id

    def poll(self, timeout: float = 0.5) -> int:
        """Fold what arrives within ``timeout``; refresh lag and state when due. Returns records read."""
        envs = self.consumer.poll(timeout)
        with self.lock:
            for env in envs:
                self.view.observe(env.topic, env.record)
        if self.lag_every_s > 0 and time.monotonic() - self._refreshed >= self.lag_every_s:
            self.refresh()
        return len(envs)

    def refresh(self) -> None:
        """The roles' committed lag and the run's state, now."""
        self._refreshed = time.monotonic()
        try:
            state = get_run(self.bootstrap, self.run_id).state
            lag = tuple(for_run_state(committed_lag(self.bootstrap, self.run_id), state))
        except Exception as exc:
            log.warning("lag/state refresh failed: %s", exc)
            return
        with self.lock:
            self.view.lag, self.view.state = lag, state

    def close(self) -> None:
        self.consumer.close()


__all__ = ["FEED_TOPICS", "RunFeed"]
