"""The restart rule of ``dora-rl run``: dead roles come back with backoff, a crash loop fails the run."""

from __future__ import annotations

from typing import Any

from dora_rl.supervisor import RestartPolicy, Supervisor


def test_policy_finishes_restarts_with_backoff_and_fails_a_crash_loop() -> None:
    p = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=(0.5, 1.0, 2.0))
    assert p.decide(0, [], 10.0) == ("finished", 0.0)
    assert p.decide(-9, [], 10.0) == ("restart", 0.5)  # SIGKILL
    assert p.decide(1, [1.0], 10.0) == ("restart", 1.0)
    assert p.decide(1, [1.0, 2.0, 3.0, 4.0], 100.0) == ("restart", 2.0)  # old deaths are out of the window
    assert p.decide(1, [8.0, 9.0, 9.5], 10.0) == ("fail", 0.0)


class FakeProc:
    def __init__(self, code: int | None) -> None:
        self.code = code
        self.pid = 1

    def poll(self) -> int | None:
        return self.code


def test_supervisor_restarts_dead_roles_and_counts_them() -> None:
    spawned: list[tuple[str, int]] = []
    procs: dict[str, FakeProc] = {}

    def spawn(role: str, index: int) -> Any:
        spawned.append((role, index))
        procs[role] = FakeProc(None)
        return procs[role]

    sup = Supervisor(spawn, RestartPolicy(max_restarts=2, window_s=100.0, backoff_s=(1.0,)))
    sup.start("trainer", "trainer")
    sup.start("dataset", "dataset")
    procs["dataset"].code = 0
    procs["trainer"].code = -9
    assert sup.check(0.0) is None
    assert sup.finished("dataset") and not sup.finished("trainer")
    assert sup.check(0.5) is None and spawned.count(("trainer", 0)) == 1  # backoff not over yet
    assert sup.check(1.0) is None and spawned.count(("trainer", 0)) == 2  # restarted
    assert sup.restarts() == {"trainer": 1}
    procs["trainer"].code = 1
    assert sup.check(2.0) is None
    assert sup.check(3.0) is None and spawned.count(("trainer", 0)) == 3
    procs["trainer"].code = 1
    failed = sup.check(4.0)
    assert failed is not None and "trainer keeps dying" in failed


def test_a_role_stopped_by_a_signal_exits_128_plus_it_so_the_supervisor_restarts_it() -> None:
    import os
    import signal

    from dora_rl.roles import STOP_SIGNALS, StopFlag

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        flag = StopFlag().install()
        assert not flag.is_set() and flag.exit_code() == 0  # finished its work: 0, "finished"
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one's code
        assert flag.is_set() and flag.exit_code() == 128 + signal.SIGHUP
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    action, _ = RestartPolicy().decide(flag.exit_code(), [], now=0.0)
    assert action == "restart"
