"""The rollout instance's request book (producers/rollout/instance_rules.py): C1, admission, cancels, hand-back and
the commit position as pure rules, checked against random event sequences with no broker and no engine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dora_rl.producers.rollout.instance_rules import RequestBook
from dora_rl.schemas.records import RolloutRequest


def _req(n: int, version: int) -> RolloutRequest:
    return RolloutRequest(run_id="r", trajectory_id=f"r/p{n}/0", group_id=f"r/p{n}", prompt_id=f"p{n}", sample_index=0,
                          group_size=1, policy_version=version, instance_id="rollout-0", action="GENERATE", task="t",
                          reference="", prompt_ids=np.array([1, 2]), partial_ids=np.array([], dtype=np.int32),
                          partial_logprobs=np.array([], dtype=np.float32), max_new_tokens=8)


def _check(book: RequestBook, offsets: dict[str, int]) -> None:
    assert book.running <= set(book.pending), "a running request is pending until it finishes"
    assert all(int(book.request(t).policy_version) == book.held for t in book.running), "C1"
    unfinished = [offsets[t] for t in book.pending]
    assert book.commit_below(10**9) == min(unfinished, default=10**9), "the commit never passes an unfinished request"


@pytest.mark.parametrize("seed", range(6))
def test_random_events_keep_c1_and_never_commit_past_an_unfinished_request(seed: int) -> None:
    rng, book, offsets = random.Random(seed), RequestBook(capacity=3), {}
    n = 0
    for _ in range(400):
        op = rng.choice(["take", "take", "copy", "cancel", "start", "join", "finish", "fail", "switch", "refuse_join"])
        if op == "take":
            req = _req(n, rng.randrange(3))
            offsets[req.trajectory_id] = n
            assert book.take(n, req)
            n += 1
        elif op == "copy" and book.pending:  # a re-read (restart) or a duplicate: taken once
            tid = rng.choice(sorted(book.pending))
            assert not book.take(n, book.request(tid))
        elif op == "cancel" and offsets:
            tid = rng.choice(sorted(offsets))
            was_running, was_pending = tid in book.running, tid in book.pending
            out = book.cancel(tid)
            assert out.kind == ("running" if was_running else "queued" if was_pending else "unknown")
            assert (tid in book.pending) == was_running
        elif op in ("start", "join"):
            new_call = op == "start"
            if new_call and not book.running and (v := book.next_version()) is not None:
                book.hold(v)
            if new_call and book.running:
                continue  # a new call starts only when the last one ended
            start = book.start(new_call)
            assert all(int(r.policy_version) == book.held for r in start.batch) and len(book.running) <= 3
        elif op == "finish" and book.running:
            book.finished(rng.choice(sorted(book.running)))
        elif op == "fail" and book.running:
            failed = book.call_failed()
            assert failed and not (set(failed) & book.running) and set(failed) <= set(book.pending)
        elif op == "refuse_join" and book.running:
            tids = rng.sample(sorted(book.running), 1)
            book.not_started(tids)
            assert not set(tids) & book.running
        elif op == "switch" and book.running:
            other = book.held + 1
            with pytest.raises(RuntimeError, match="C1"):
                book.hold(other)
        _check(book, offsets)


def test_the_held_version_is_kept_while_it_has_work_then_the_oldest_pending_is_taken() -> None:
    book = RequestBook(capacity=2)
    for i, v in enumerate([2, 1, 2, 3]):
        book.take(i, _req(i, v))
    assert book.next_version() == 1  # nothing held: the oldest pending version
    book.hold(1)
    assert [r.trajectory_id for r in book.start(new_call=True).batch] == ["r/p1/0"]
    book.hold(1)
    assert book.next_version() == 1  # a running call keeps its version
    book.finished("r/p1/0")
    book.hold(book.next_version() or 0)
    assert book.held == 2 and [r.trajectory_id for r in book.start(new_call=True).batch] == ["r/p0/0", "r/p2/0"]
    assert book.start(new_call=False).batch == ()  # no free slot to join


def test_a_suspect_runs_alone_nothing_joins_it_and_a_refused_one_leaves_with_its_offset() -> None:
    book = RequestBook(capacity=4)
    for i in range(4):
        book.take(10 + i, _req(i, 0))
    book.hold(0)

    def split(queued):  # type: ignore[no-untyped-def]
        return ([r for r in queued if r.trajectory_id == "r/p0/0"], [r for r in queued if r.trajectory_id == "r/p1/0"],
                [r for r in queued if r.trajectory_id not in ("r/p0/0", "r/p1/0")])
    start = book.start(new_call=True, split=split)
    assert [r.trajectory_id for r in start.batch] == ["r/p1/0"] and start.alone
    assert [(o, r.trajectory_id) for o, r in start.refused] == [(10, "r/p0/0")] and "r/p0/0" not in book.pending
    assert book.start(new_call=False, split=split).batch == ()  # nothing joins a suspect
    book.finished("r/p1/0")
    assert [r.trajectory_id for r in book.start(new_call=True, split=split).batch] == ["r/p2/0", "r/p3/0"]


def test_a_graceful_leave_hands_back_the_queued_and_keeps_the_running() -> None:
    book = RequestBook(capacity=1)
    for i in range(3):
        book.take(i, _req(2 - i, 0))
    book.hold(0)
    running = book.start(new_call=True).batch[0].trajectory_id
    back = book.hand_back()
    assert running not in {r.trajectory_id for r in back} and [r.trajectory_id for r in back] == sorted(
        r.trajectory_id for r in back) and len(back) == 2
    assert set(book.pending) == {running} and book.commit_below(99) == 0


def test_requests_a_call_ended_without_are_queued_again_and_start_in_the_next_call() -> None:
    """An engine that accepted a join and dropped it (the emulated engine did, 2026-11-28): when the call
    returns, what is still marked running goes back to queued, so the instance does not wait on it forever."""
    book = RequestBook(capacity=4)
    book.take(0, _req(1, 0))
    book.hold(0)
    assert [r.trajectory_id for r in book.start(new_call=True).batch] == ["r/p1/0"]
    book.take(1, _req(2, 0))
    assert [r.trajectory_id for r in book.start(new_call=False).batch] == ["r/p2/0"]  # joined
    book.finished("r/p1/0")  # the engine reported the first, never the joined one
    assert book.call_ended() == ["r/p2/0"]
    assert [r.trajectory_id for r in book.start(new_call=True).batch] == ["r/p2/0"]
    book.finished("r/p2/0")
    assert book.call_ended() == [] and not book.pending
