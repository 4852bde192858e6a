"""Snapshots of the scheduling rules' state: JSON-able, small, restorable into a fresh scheduler.

The orchestrator commits one snapshot with every transaction (:mod:`dora_rl.streams.kafka_runtime`),
so a restarted orchestrator continues from exactly the state its committed outputs were decided in.
Payloads the rules carry opaquely (queued prompts, migrating partial responses) go through the
caller's ``dump``/``load`` callbacks, which turn them into references to the log and back.

Invariant (tested): ``load_state(fresh, dump_state(s, d), l)`` then any sequence of events gives
the same decisions as ``s`` given the same events. The re-partition timer restarts at restore (the
clock of the old process is meaningless to the new one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .dora_policy import DoraScheduler
from .dora_state import ResumeQueue, TrajState
from .kv_room import LengthMoments
from .planning import Planner
from .scheduling import Scheduler, SchedulingRules
from .scheduling_events import Cancel, Migration

Dump = Callable[[Any], Any]
Load = Callable[[Any], Any]


def dump_planner(p: Planner) -> dict[str, Any]:
    return {"next_step": p.next_step, "version_of": p.version_of, "group_of": p.group_of,
            "members": {g: sorted(m) for g, m in p.members.items()}, "done": sorted(p.done),
            "completed_seq": p.completed_seq, "seq": p._seq}


def load_planner(p: Planner, d: dict[str, Any]) -> None:
    p.next_step = int(d["next_step"])
    p.version_of = {k: int(v) for k, v in d["version_of"].items()}
    p.group_of = dict(d["group_of"])
    p.members = {g: set(m) for g, m in d["members"].items()}
    p.done = set(d["done"])
    p.completed_seq = {g: int(v) for g, v in d["completed_seq"].items()}
    p._seq = int(d["seq"])
    p.reindex()


def dump_state(s: SchedulingRules[Any], dump: Dump) -> dict[str, Any]:
    """The whole state of a scheduler of any mode."""
    if isinstance(s, DoraScheduler):
        st = s.state
        return {
            "kind": "dora", "latest": st.latest, "next_cut": st.next_cut, "dispatched": st.dispatched,
            "trajs": {t: [x.version, x.instance, x.group_id, x.done] for t, x in st.trajs.items()},
            "instance_version": st.instance_version, "migrating": st.migrating,
            "draining": {str(i): v for i, v in st.draining.items()},
            "planner": dump_planner(s.planner), "prompts": [[g, dump(p)] for g, p in s._prompts],
            "resume": [[m.trajectory_id, m.version, None if m.partial is None else dump(m.partial), v]
                       for m, v in s._resume],
            "members": s.members.dump(), "redispatched": s.redispatched,
            "cancels": [[c.instance, list(c.trajectory_ids), list(c.versions)] for c in s.cancels],
            "repartitions": s.repartitions, "switches": s.switches, "last_repartition": s._last_repartition,
            "refused_groups": s.refused_groups, "withdrawn": s._withdrawn,
            "lengths": [s.lengths.count, s.lengths.prompt_sum, s.lengths.response_sum, s.lengths.response_sq_sum],
            "slots": s.slots,
        }
    if isinstance(s, Scheduler):
        w = s.state
        return {"kind": "waves", "latest": w.latest_version, "waves": w.waves_dispatched,
                "consumed": w.consumed_steps, "in_flight": w.in_flight, "version_of": w.version_of,
                "planner": dump_planner(s.planner), "prompts": [[g, dump(p)] for g, p in s._prompts],
                "replacements": s.replacements, "refused_groups": s.refused_groups,
                "withdrawn": s._withdrawn}
    raise TypeError(f"no snapshot codec for {type(s).__name__}")


def load_state(s: SchedulingRules[Any], d: dict[str, Any], load: Load) -> None:
    """Restore ``dump_state`` output into a freshly made scheduler of the same config."""
    if isinstance(s, DoraScheduler):
        if d["kind"] != "dora":
            raise ValueError(f"snapshot of a {d['kind']} scheduler cannot restore a DORA scheduler")
        st = s.state
        st.latest, st.next_cut, st.dispatched = int(d["latest"]), int(d["next_cut"]), int(d["dispatched"])
        st.restore({t: TrajState(int(v), int(i), str(g), bool(done)) for t, (v, i, g, done) in d["trajs"].items()},
                   [int(v) for v in d["instance_version"]])
        st.migrating = {t: int(v) for t, v in d["migrating"].items()}
        st.drain({int(i): int(v) for i, v in d.get("draining", {}).items()})
        load_planner(s.planner, d["planner"])
        s._prompts = deque((g, load(p)) for g, p in d["prompts"])
        s._resume = ResumeQueue((Migration(t, int(v), None if partial is None else load(partial)), int(rv))
                                for t, v, partial, rv in d["resume"])
        s.members.load(d.get("members", {}))
        s.redispatched = int(d.get("redispatched", 0))
        s.cancels = [Cancel(int(c[0]), tuple(c[1]), tuple(int(v) for v in (c[2] if len(c) > 2 else ())))
                     for c in d["cancels"]]
        s.repartitions, s.switches = int(d["repartitions"]), int(d["switches"])
        s.refused_groups = int(d.get("refused_groups", 0))
        s._withdrawn = [str(g) for g in d.get("withdrawn", [])]
        s._last_repartition = float(d["last_repartition"])
        n, ps, rs, rss = d.get("lengths", [0, 0.0, 0.0, 0.0])
        s.lengths = LengthMoments(int(n), float(ps), float(rs), float(rss))
        s.slots = int(d.get("slots", s.capacity))
        s._heaps.reset()
        return
    if isinstance(s, Scheduler):
        if d["kind"] != "waves":
            raise ValueError(f"snapshot of a {d['kind']} scheduler cannot restore a wave scheduler")
        w = s.state
        w.latest_version, w.waves_dispatched, w.consumed_steps = int(d["latest"]), int(d["waves"]), int(d["consumed"])
        w.in_flight = {t: int(i) for t, i in d["in_flight"].items()}
        w.version_of = {t: int(v) for t, v in d["version_of"].items()}
        load_planner(s.planner, d["planner"])
        s._prompts = deque((g, load(p)) for g, p in d["prompts"])
        s.replacements = [int(v) for v in d.get("replacements", [])]
        s.refused_groups = int(d.get("refused_groups", 0))
        s._withdrawn = [str(g) for g in d.get("withdrawn", [])]
        return
    raise TypeError(f"no snapshot codec for {type(s).__name__}")


def payloads(d: dict[str, Any]) -> list[Any]:
    """Every dumped payload in a snapshot (what ``load`` will be asked for), to fetch them at once."""
    return [p for _, p in d["prompts"]] + [r[2] for r in d.get("resume", []) if r[2] is not None]
