"""The JSON document ``GET /api/run`` returns (pure: a snapshot and a timeline in, plain data out).

Shape (every time in epoch milliseconds, every rate per second)::

    {"run": {"id", "mode", "state", "max_staleness", "steps_target", "done", "latest_version"},
     "now_ms", "step_count", "reward", "throughput_tokens_per_s", "dlq": {"total", "per_min", "by_reason"},
     "steps": [{"step", "reward", "tokens_per_s", "trained_tokens", "staleness_max", "staleness_mean", "ts_ms"}],
     "staleness_recent": [[staleness, trajectories], ...], "recent_batches",
     "versions": [{"version", "pending", "in_flight", "instances"}],
     "instances": [{"id", "version", "state", "in_flight", "capacity", "tokens_per_s", "idle_fraction"}],
     "timeline": {"start_ms", "end_ms", "rows": [{"instance", "idle_fraction",
                                                  "segments": [[start_ms, end_ms, version, state], ...]}]},
     "lag": [{"role", "topic", "partitions", "lag"}], "endpoints": {name: "host:port"}}

A timeline row keeps its newest ``max_segments`` segments (older ones are dropped from the document,
never merged, so what is drawn is always what the heartbeats said).
"""

from __future__ import annotations

from typing import Any

from ..monitor_view import RunSnapshot
from ..timeline import Timeline


def _f(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def payload(s: RunSnapshot, timeline: Timeline, max_segments: int = 2000) -> dict[str, Any]:
    """The document of the module docstring."""
    span = timeline.span()
    rows = [{"instance": iid, "idle_fraction": _f(timeline.idle_fraction(iid)),
             "segments": [[g.start_ms, g.end_ms, g.version, g.state] for g in segs[-max_segments:]]}
            for iid, segs in timeline.rows().items()]
    return {
        "run": {"id": s.run_id, "mode": s.mode, "state": s.state, "max_staleness": s.max_staleness,
                "steps_target": s.steps_target, "done": s.done, "latest_version": s.latest_version},
        "now_ms": s.now_ms, "step_count": s.step_count, "reward": _f(s.reward),
        "throughput_tokens_per_s": _f(s.throughput_tokens_per_s, 1),
        "dlq": {"total": s.dlq_total, "per_min": s.dlq_per_min, "by_reason": dict(s.dlq_by_reason)},
        "steps": [{"step": r.step, "reward": _f(r.reward), "tokens_per_s": _f(r.tokens_per_s, 1),
                   "trained_tokens": r.trained_tokens, "staleness_max": r.staleness_max,
                   "staleness_mean": _f(r.staleness_mean), "ts_ms": r.ts_ms} for r in s.steps],
        "staleness_recent": [list(p) for p in s.staleness_recent], "recent_batches": s.recent_batches,
        "versions": [{"version": v.version, "pending": v.pending, "in_flight": v.in_flight,
                      "instances": list(v.instances)} for v in s.versions],
        "instances": [{"id": i.instance_id, "version": i.version, "state": i.state, "in_flight": i.in_flight,
                       "capacity": i.capacity, "tokens_per_s": _f(i.tokens_per_s, 1),
                       "idle_fraction": _f(i.idle_fraction)} for i in s.instances],
        "timeline": {"start_ms": span[0] if span else None, "end_ms": span[1] if span else None, "rows": rows},
        "lag": [{"role": r.role, "topic": r.topic, "partitions": r.partitions, "lag": r.lag} for r in s.lag],
        "endpoints": dict(s.endpoints),
    }


__all__ = ["payload"]
