"""The one reward runner: each call of a reward function (:mod:`dora_rl.core.rewards`) in a killable worker.

:class:`RewardRunner` runs the calls in a persistent worker process (``python -P -c``, its own
session, the parent's ``sys.path`` and the current directory as ``PYTHONPATH``, no secret of the run in
its environment), on the worker's **main thread**, so verifiers built on ``signal.alarm`` (math-verify)
work. The parent never runs reward code: it sends a whole batch in one message, the worker streams back
one result per item, and the parent waits at most ``timeout_s`` for each; on a timeout (or a crash) it
SIGKILLs the worker's process group and sends the items after the culprit to a spare worker, started in
advance (so a replacement does not wait for the verifier's imports). The timeout is enforced by the
parent, not by a signal in the worker, so a verifier that owns ``SIGALRM`` or hangs in C code is still
cut off. Not multiprocessing: its ``spawn``/``forkserver`` re-run the parent's ``__main__`` script in the
worker. No item's failure is raised or swallowed: it is an outcome and the runner goes on. Only a worker
that cannot be started raises (``ValueError`` for a reward function that cannot be resolved,
``RuntimeError`` otherwise).

Invariants (``tests/unit/test_rewards.py``):

* each item's outcome arrives within ``timeout_s`` + small overhead after the previous one, so
  ``score`` returns within ``timeout_s`` + overhead and ``score_many`` of n items within
  ``n * timeout_s`` + overhead at worst;
* after a timeout or a crash the worker is killed and replaced before the next item runs;
* ``score_many`` returns exactly one outcome per request, in the order of the requests.

A runner is not thread-safe; :meth:`RewardRunner.close` (or ``with``, or garbage collection, or
interpreter exit) kills its workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

from dora_rl.core.rewards import (
    Outcome,
    RewardError,
    RewardRequest,
    _Wire,
    call_reward,
    resolve_reward_fn,
)


def _worker_main(fd: int, spec: str) -> None:
    """The worker: resolve ``spec``, then score batches (lists of triples) until EOF or ``None``."""
    conn = Connection(fd)
    try:
        fn = resolve_reward_fn(spec)
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", ""))
    with contextlib.suppress(EOFError, OSError):  # the parent went away
        while (batch := conn.recv()) is not None:
            for task, reference, completion in batch:
                conn.send(call_reward(fn, task, reference, completion))


_BOOT = ("import sys; from dora_rl.infra.reward_worker import _worker_main; "
         "_worker_main(int(sys.argv[1]), sys.argv[2])")


SECRET_ENV_PREFIXES = ("DORA_KAFKA_", "DORA_WEIGHT_TOKEN")
"""Variables a reward worker never inherits: Kafka credentials (and where they are) and the run's weight
token. The worker runs verifier code on model output; it needs neither."""


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables of :data:`SECRET_ENV_PREFIXES`."""
    return {k: v for k, v in env.items() if not k.startswith(SECRET_ENV_PREFIXES)}


class _Worker:
    """One worker process, leader of its own process group, and the parent's end of its socket."""

    def __init__(self, spec: str) -> None:
        ours, theirs = socket.socketpair()
        env = {**worker_env(os.environ), "PYTHONPATH": os.pathsep.join([*(p or os.getcwd() for p in sys.path),
                                                                          os.getcwd()])}  # `mod:fn` in the cwd
        try:
            self.proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT, str(theirs.fileno()), spec],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float, spec: str) -> None:
        """Until the worker has resolved ``spec``; ValueError (bad spec) or RuntimeError, worker killed."""
        if self.ready:
            return
        try:
            if not self.conn.poll(timeout):
                raise RuntimeError(f"reward worker for {spec!r} did not start within {timeout:g} s")
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(f"reward worker for {spec!r} exited while starting "
                               f"(exit code {self.proc.returncode})") from None
        except BaseException:
            self.kill()
            raise
        if status != "ready":
            self.kill()
            raise ValueError(detail)
        self.ready = True

    def kill(self) -> None:
        """SIGKILL the process group (only while the pid is unreaped, hence still ours) and reap it."""
        self.conn.close()
        if self.proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class RewardRunner:
    """Runs ``reward_fn`` (see :func:`resolve_reward_fn`) in a worker process, ``timeout_s`` per call.

    The first worker starts in the constructor, so an unresolvable ``reward_fn`` raises ValueError
    here. With ``spare`` (default) a second, idle worker is kept started to replace the first after a
    timeout or crash. ``restarts`` counts the replacements.
    """

    def __init__(self, reward_fn: str = "task", timeout_s: float = 10.0, *, start_timeout_s: float = 120.0,
                 spare: bool = True) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.reward_fn = reward_fn
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.spare = spare
        self.restarts = 0
        self.closed = False
        self._workers: list[_Worker] = []  # every worker alive: the current one and the spare
        self._current: _Worker | None = None
        self._spare: _Worker | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)  # also at interpreter exit
        try:
            self._worker()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _launch(self) -> _Worker:
        w = _Worker(self.reward_fn)
        self._workers.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)

    def _drop_current(self) -> None:
        """Kill the current worker (timed out, crashed or gone); the next call promotes the spare."""
        if self._current is not None:
            self._retire(self._current)
            self._current = None
            self.restarts += 1

    def _worker(self) -> _Worker:
        """The live, ready worker: the current one, else the spare (promoted; a new spare starts)."""
        if self._current is not None and self._current.alive():
            return self._current
        self._drop_current()  # died while idle
        w, self._spare = self._spare, None
        if w is None or not w.alive():
            if w is not None:
                self._retire(w)
            w = self._launch()
        if self.spare:
            self._spare = self._launch()  # starts while ``w`` works
        w.wait_ready(self.start_timeout_s, self.reward_fn)
        self._current = w
        return w

    def _send(self, batch: list[tuple[str, str, str]]) -> _Worker:
        for attempt in range(2):
            w = self._worker()
            try:
                w.conn.send(batch)
                return w
            except OSError:  # died between the liveness check and the send
                self._drop_current()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def score(self, task: str, reference: str, completion: str, item: str = "") -> Outcome:
        """The reward of one completion, or why there is none."""
        return self.score_many([RewardRequest(task, reference, completion, item)])[0]

    def score_many(self, requests: Sequence[RewardRequest]) -> list[Outcome]:
        """One outcome per request, in order; the batch goes to the worker in one message."""
        if self.closed:
            raise RuntimeError("reward runner is closed")
        out: list[Outcome] = []
        while len(out) < len(requests):
            pending = requests[len(out):]
            w = self._send([(r.task, r.reference, r.completion) for r in pending])
            for req in pending:
                failed: tuple[str, str, str] | None = None
                if not w.conn.poll(self.timeout_s):
                    failed = ("timeout", "", f"no result within {self.timeout_s:g} s; worker killed and replaced")
                else:
                    try:
                        msg: _Wire = w.conn.recv()
                    except (EOFError, OSError):
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            w.proc.wait(1.0)
                        failed = ("crashed", "", f"the worker died (exit code {w.proc.returncode}); replaced")
                if failed is not None:
                    out.append(self._error(req, failed))
                    self._drop_current()  # the items after the culprit go to the next worker
                    break
                out.append(msg if isinstance(msg, float) else self._error(req, msg))
        assert len(out) == len(requests)
        return out

    def _error(self, req: RewardRequest, wire: tuple[str, str, str]) -> RewardError:
        kind, exc_type, detail = wire
        return RewardError(kind=kind, detail=detail, task=req.task, item=req.item,  # type: ignore[arg-type]
                           exc_type=exc_type, reward_fn=self.reward_fn)

    def close(self) -> None:
        """Stop the workers (the current one asked to exit, killed after a second). Idempotent."""
        self.closed = True
        w = self._current
        if w is not None and w.alive():
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                w.conn.send(None)
                w.proc.wait(1.0)
        self._current = self._spare = None
        self._finalizer()
