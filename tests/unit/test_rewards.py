"""The reward runner (``dora_rl.core.rewards``): typed outcomes, per-call timeout, worker replacement.

The module-level functions below are the reward functions under test; the worker imports them by
entry point (``f"{__name__}:name"``), so they must stay importable at module level.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dora_rl.core.rewards import RewardError, RewardRequest, call_reward, resolve_reward_fn
from dora_rl.core.tasks import get_task
from dora_rl.infra.reward_worker import RewardRunner

HERE = __name__


def prefix_match(task: str, reference: str, completion: str) -> float:
    return 1.0 if completion.startswith(reference) else 0.0


def raises(task: str, reference: str, completion: str) -> float:
    raise ZeroDivisionError(f"cannot score {completion!r}")


def returns_nan(task: str, reference: str, completion: str) -> float:
    return math.nan


def returns_too_much(task: str, reference: str, completion: str) -> float:
    return 1.5


def returns_text(task: str, reference: str, completion: str) -> float:
    return "high"  # type: ignore[return-value]


def hangs_on_hang(task: str, reference: str, completion: str) -> float:
    if completion == "hang":
        time.sleep(60)
    return 0.25


def dies_on_die(task: str, reference: str, completion: str) -> float:
    if completion == "die":
        os._exit(3)
    return 0.5


def secret_count(task: str, reference: str, completion: str) -> float:
    """How many of the run's secrets the worker's environment holds, as a reward (0.1 each)."""
    return 0.1 * sum(1 for k in os.environ if k.startswith(("DORA_KAFKA_", "DORA_WEIGHT_TOKEN")))


def with_alarm(task: str, reference: str, completion: str) -> float:
    """Like math-verify: a SIGALRM-based timeout, which only works on the main thread."""
    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError

    old = signal.signal(signal.SIGALRM, on_alarm)  # ValueError off the main thread
    signal.alarm(5)
    try:
        return 1.0 if completion == reference else 0.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def main_thread_sleeper(task: str, reference: str, completion: str) -> float:
    """Hangs in a way a worker-side SIGALRM would not stop: the parent's timeout must still."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)
    return 1.0


@pytest.fixture(scope="module")
def task_runner() -> Iterator[RewardRunner]:
    with RewardRunner("task", timeout_s=5.0) as runner:
        yield runner


def test_task_reward_matches_the_task_verifier(task_runner: RewardRunner) -> None:
    task = get_task("reverse")
    assert task_runner.score("reverse", "abcd", "abcd") == 1.0
    assert task_runner.score("reverse", "abcd", "abcx") == task.reward("abcd", "abcx")
    assert task_runner.score("chainsum", "33,92#2", "xx#2") == 1.0


def test_unknown_task_is_a_typed_error(task_runner: RewardRunner) -> None:
    out = task_runner.score("nosuchtask", "a", "a", item="traj-7")
    assert isinstance(out, RewardError) and out.kind == "unknown_task"
    assert "nosuchtask" in out.message and "traj-7" in out.message and "reverse" in out.detail


def test_batch_keeps_order_and_mixes_outcomes(task_runner: RewardRunner) -> None:
    reqs = [RewardRequest("reverse", "ab", "ab", "t0"), RewardRequest("bogus", "ab", "ab", "t1"),
            RewardRequest("reverse", "ab", "zz", "t2")]
    out = task_runner.score_many(reqs)
    assert out[0] == 1.0 and isinstance(out[1], RewardError) and out[2] == 0.0
    assert task_runner.score_many([]) == []


def test_a_reward_module_in_the_current_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--reward-fn mymod:fn`` run from the folder holding ``mymod.py`` (as ``dora-rl replay rescore`` is)."""
    (tmp_path / "cwd_reward_mod.py").write_text("def fn(task, reference, completion):\n    return 0.75\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with RewardRunner("cwd_reward_mod:fn", timeout_s=5.0) as runner:
        assert runner.score("any", "", "") == 0.75


def test_entry_point_is_resolved() -> None:
    assert resolve_reward_fn(f"{HERE}:prefix_match") is prefix_match
    with RewardRunner(f"{HERE}:prefix_match", timeout_s=5.0) as runner:
        assert runner.score("any", "ab", "abc") == 1.0
        assert runner.score("any", "ab", "xab") == 0.0


def test_the_worker_environment_holds_no_kafka_secret_and_no_weight_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker runs verifier code on model output: it inherits no credential (issue 32)."""
    secrets = {"DORA_KAFKA_SASL_PASSWORD": "hunter2", "DORA_KAFKA_SASL_USERNAME": "trainer",
               "DORA_KAFKA_CLIENT_CONFIG": "/run/client.toml", "DORA_WEIGHT_TOKEN": "t0k3n",
               "DORA_WEIGHT_TOKEN_FILE": "/run/token"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    assert secret_count("", "", "") == pytest.approx(0.5)  # this process holds them
    with RewardRunner(f"{HERE}:secret_count", timeout_s=5.0) as runner:
        assert runner.score("any", "", "") == 0.0


@pytest.mark.parametrize("spec", ["nope", "no_such_module_xyz:f", f"{HERE}:missing", f"{HERE}:HERE", ":f"])
def test_unresolvable_reward_fn_fails_at_construction(spec: str) -> None:
    with pytest.raises(ValueError, match="reward function"):
        RewardRunner(spec, timeout_s=1.0)


def test_raising_function_gives_raised_with_type_and_message() -> None:
    with RewardRunner(f"{HERE}:raises", timeout_s=5.0) as runner:
        out = runner.score("reverse", "ab", "ba", item="traj-1")
    assert isinstance(out, RewardError) and out.kind == "raised"
    assert out.exc_type == "ZeroDivisionError" and "cannot score 'ba'" in out.detail
    assert "traj-1" in out.message and "'reverse'" in out.message and "ZeroDivisionError" in out.message


@pytest.mark.parametrize("fn,shown", [("returns_nan", "nan"), ("returns_too_much", "1.5"), ("returns_text", "high")])
def test_non_finite_or_out_of_range_is_invalid(fn: str, shown: str) -> None:
    with RewardRunner(f"{HERE}:{fn}", timeout_s=5.0) as runner:
        out = runner.score("reverse", "ab", "ab")
    assert isinstance(out, RewardError) and out.kind == "invalid" and shown in out.detail


def test_validity_rule_in_process() -> None:
    assert call_reward(prefix_match, "t", "a", "a") == 1.0
    assert call_reward(returns_nan, "t", "a", "a")[0] == "invalid"  # type: ignore[index]
    assert call_reward(raises, "t", "a", "a")[:2] == ("raised", "ZeroDivisionError")  # type: ignore[index]


def test_hanging_call_times_out_and_the_next_call_works() -> None:
    with RewardRunner(f"{HERE}:hangs_on_hang", timeout_s=0.5) as runner:
        assert runner._current is not None
        first_pid = runner._current.proc.pid
        t0 = time.monotonic()
        out = runner.score("reverse", "ab", "hang", item="traj-h")
        took = time.monotonic() - t0
        assert isinstance(out, RewardError) and out.kind == "timeout", out
        assert took < 2.0, took
        assert "traj-h" in out.message and "0.5 s" in out.message
        assert runner.score("reverse", "ab", "fine") == 0.25  # a new worker
        assert runner.restarts == 1 and runner._current.proc.pid != first_pid
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)  # the hung worker is gone (killed and reaped)


def test_timeout_in_a_batch_hits_only_the_culprit() -> None:
    with RewardRunner(f"{HERE}:hangs_on_hang", timeout_s=0.5) as runner:
        comps = ["a", "hang", "b", "hang", "c"]
        t0 = time.monotonic()
        out = runner.score_many([RewardRequest("reverse", "x", c, str(i)) for i, c in enumerate(comps)])
        # two 0.5 s timeouts, plus waiting for a spare that started 0.5 s before it is needed (a new Python
        # process: slow on a loaded machine); without the timeout the call would hang on the first "hang"
        assert time.monotonic() - t0 < 6.0
        kinds = [o.kind if isinstance(o, RewardError) else o for o in out]
        assert kinds == [0.25, "timeout", 0.25, "timeout", 0.25]
        assert [o.item for o in out if isinstance(o, RewardError)] == ["1", "3"]
        assert runner.restarts == 2


def test_timeout_is_enforced_even_if_the_function_owns_sigalrm() -> None:
    with RewardRunner(f"{HERE}:main_thread_sleeper", timeout_s=0.5) as runner:
        out = runner.score("reverse", "a", "a")
    assert isinstance(out, RewardError) and out.kind == "timeout"


def test_worker_crash_is_typed_and_the_worker_replaced() -> None:
    with RewardRunner(f"{HERE}:dies_on_die", timeout_s=5.0) as runner:
        out = runner.score_many([RewardRequest("reverse", "x", c) for c in ["ok", "die", "ok"]])
        assert out[0] == 0.5 and out[2] == 0.5
        assert isinstance(out[1], RewardError) and out[1].kind == "crashed" and "exit code 3" in out[1].detail
        assert runner._current is not None
        runner._current.proc.kill()  # a worker that died while idle is replaced too
        runner._current.proc.wait()
        assert runner.score("reverse", "x", "ok") == 0.5


def test_signal_alarm_function_runs_on_the_workers_main_thread() -> None:
    with RewardRunner(f"{HERE}:with_alarm", timeout_s=5.0) as runner:
        assert runner.score("reverse", "ab", "ab") == 1.0
        assert runner.score("reverse", "ab", "ba") == 0.0


def test_close_kills_the_worker_and_refuses_more_work() -> None:
    runner = RewardRunner("task", timeout_s=1.0)
    procs = [w.proc for w in runner._workers]
    assert len(procs) == 2  # the current worker and the spare
    runner.close()
    runner.close()  # idempotent
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        runner.score("reverse", "a", "a")


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner("task", timeout_s=0)
