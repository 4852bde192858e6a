"""The poison-input rule (dora_rl.core.attempts): culprits are isolated and refused, batch-mates never."""

from __future__ import annotations

from dora_rl.core.attempts import Attempts, Tries, verdict


def test_a_raising_request_is_isolated_then_refused_after_max_attempts_alone() -> None:
    a = Attempts()
    batch = ["g/0", "g/1", "h/0"]
    a.started(batch, alone=False)
    a.raised(batch)  # the call raised with all three unfinished
    assert [a.verdict(r, 2) for r in batch] == ["alone"] * 3
    for rid in ["g/0", "h/0"]:  # innocent: finish alone
        a.started([rid], alone=True)
        a.finished(rid)
    for expected in ["alone", "refuse"]:
        a.started(["g/1"], alone=True)
        a.raised(["g/1"])
        assert a.verdict("g/1", 2) == expected
    assert a.of("g/1") == Tries(died=0, raised=3, alone_failed=2)
    assert set(a.tries) == {"g/1"}


def test_one_process_death_is_not_blamed_on_its_batch_two_are() -> None:
    a = Attempts()
    a.started(["x", "y"], alone=False)  # the process dies here: the record says so
    b = Attempts.loads(a.dumps())  # the next incarnation
    assert b.verdict("x", 2) == "batch"
    b.started(["x", "y"], alone=False)  # dies again
    c = Attempts.loads(b.dumps())
    assert c.verdict("x", 2) == "alone"
    c.started(["x"], alone=True)
    c.finished("x")  # innocent
    for expected in ["alone", "refuse"]:  # y kills the process alone, twice
        c.started(["y"], alone=True)
        c = Attempts.loads(c.dumps())
        assert c.verdict("y", 2) == expected
    assert c.of("y").failures == 4, "a killer request is refused after 2 + max_attempts deaths"


def test_an_undone_join_leaves_no_trace() -> None:
    a = Attempts()
    a.started(["z"], alone=False)
    a.not_started(["z"], alone=False)
    assert a.tries == {} and verdict(a.of("z"), 1) == "batch"
