"""A DORA run started the way a multi-host deployment starts it: ``dora-rl create``, then each role by
itself (any order, rollout instances with ``--index auto``), with no launcher. ``spawn`` decides where
a role runs (here, or inside a network namespace); the helpers read the outcome back from Kafka.
(tests/integration is on sys.path.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Spawn = Callable[[str, list[str], dict[str, str]], "subprocess.Popen[bytes]"]
STREAM_ROLES = ("orchestrator", "assembler", "scorer")


def dora(*args: str) -> list[str]:
    return [sys.executable, "-m", "dora_rl", *args]


def local_spawn(logs: Path) -> Spawn:
    """Start a role here, its output appended to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=(logs / f"{name}.log").open("ab"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return spawn


def create_run(bootstrap: str, config_file: Path, env: dict[str, str] | None = None,
               prefix: Sequence[str] = ()) -> str:
    """``dora-rl create``: the run id (nothing started)."""
    res = subprocess.run([*prefix, *dora("create", "--bootstrap-servers", bootstrap, "--config", str(config_file))],
                         capture_output=True, text=True, timeout=120, env=env or dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split()[0]


def role_argv(role: str, bootstrap: str, run_id: str, *extra: str) -> list[str]:
    return dora(role, "--bootstrap-servers", bootstrap, "--run-id", run_id, *extra)


def claimed_indices(bootstrap: str, run_id: str) -> dict[str, int]:
    """``instance name -> index`` owned, by the rule every instance applies (core/instance_ids.py)."""
    from dora_rl.core.instance_ids import owners
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import InstanceStatus

    recs = [InstanceStatus.decode(m.value(), m.headers())
            for m in read_run(bootstrap, get_run(bootstrap, run_id), topics.INSTANCES)]
    own = owners((int(s.instance_index), s.incarnation) for s in recs if s.run_id == run_id)
    return {name: i for i, name in own.items() if name}


def stop_while_decoding(bootstrap: str, run_id: str, index: int, config: dict[str, Any],
                        proc: subprocess.Popen[bytes], min_left_s: float = 1.0, timeout: float = 120.0) -> str:
    """SIGSTOP emulated instance ``index`` (``proc``) at a moment it provably still decodes a request, and
    return that request's id (:func:`act_while_decoding`)."""
    import signal

    return act_while_decoding(bootstrap, run_id, {index}, config, lambda _: proc.send_signal(signal.SIGSTOP),
                              min_left_s, timeout)[1]


def act_while_decoding(bootstrap: str, run_id: str, indices: set[int], config: dict[str, Any],
                       act: Callable[[int], None], min_left_s: float = 1.0, timeout: float = 120.0
                       ) -> tuple[int, str]:
    """Call ``act(index)`` at a moment emulated instance ``index`` (one of ``indices``) provably still decodes a
    request, and return ``(index, that request's id)``.

    Tails the instances' heartbeats (``dora.instances``). A request id first seen in heartbeat ``h_k`` (in
    no heartbeat of any instance before: not a resumed partial) started after ``h_{k-1}``, so it has
    decoded at most ``(ts_k - ts_{k-1}) / step + 1`` tokens at ``ts_k``, where ``step >= base_step_s``
    (``core.emulation.step_time`` never goes below it). Its planned length ``L`` is known
    (``planned_length``), so at the moment the test acts it still has at least
    ``(L - decoded) * step - (now - ts_k)`` seconds to run; the test acts only when that bound is
    at least ``min_left_s``. The leave that follows then always has work to move (no race: decision 0037).
    """
    import time

    from confluent_kafka import Consumer, TopicPartition

    from dora_rl.core.emulation import EmulatedParams, for_instance, planned_length
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.read import now_ms, reader_config
    from dora_rl.infra.kafka.runs import get_run, offsets_map, topic_start
    from dora_rl.infra.kafka.security import check_kafka_error
    from dora_rl.schemas.records import InstanceStatus

    base = EmulatedParams.from_dict({"seed": config["seed"], **config.get("emulated", {})})
    params = {i: for_instance(base, i) for i in indices}
    cap = int(config["max_new_tokens"])
    instances = topics.in_run(run_id, topics.INSTANCES)
    start = topic_start(offsets_map(get_run(bootstrap, run_id)), instances)
    consumer = Consumer(reader_config(bootstrap, f"dora-test-tail-{now_ms()}"))
    consumer.assign([TopicPartition(instances, p, o) for p, o in start.items()])
    seen: set[str] = set()
    prev_ts: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for msg in consumer.consume(100, 0.1):
                check_kafka_error(msg.error(), f"tailing {instances}")
                hb = InstanceStatus.decode(msg.value(), msg.headers())
                if hb.run_id != run_id:
                    continue
                ids, index = set(hb.in_flight_ids), int(hb.instance_index)
                fresh = ids - seen
                seen |= ids
                if index not in indices:
                    continue
                ts, last = int(hb.ts_ms), prev_ts.get(index)
                prev_ts[index] = ts
                if last is None or not fresh:
                    continue
                p = params[index]
                step = p.base_step_s * p.time_scale
                decoded = (ts - last) / 1000.0 / step + 1
                longest = max(fresh, key=lambda rid: planned_length(rid, cap, p)[0])
                left = planned_length(longest, cap, p)[0] - decoded
                if left * step - (now_ms() - ts) / 1000.0 >= min_left_s:
                    act(index)
                    return index, longest
    finally:
        consumer.close()
    raise AssertionError(f"instances {sorted(indices)} started no request with {min_left_s}s of decode left "
                         f"in {timeout}s")


def run_state(bootstrap: str, run_id: str) -> str:
    """The run's state, read as its roles read it: from its latest record signed with its token (decision 0060)."""
    from dora_rl.infra.kafka.runs import get_run
    from dora_rl.roles import run_token

    return str(get_run(bootstrap, run_id, run_token(run_id)).state)


def stop(procs: dict[str, subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def netlab(hosts: Sequence[str]) -> Any:
    """A :class:`~dora_rl.infra.lab.netns.NetLab` of ``hosts`` (a context manager); without network namespaces
    the test fails under ``CI=true`` and skips elsewhere, with the reason."""
    import pytest

    from dora_rl.infra.lab.netns import NetLab, netns_available

    why = netns_available()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespaces unavailable in CI: {why}")
        pytest.skip(f"network namespaces unavailable: {why}")
    return NetLab(hosts)
