"""An external reward service scores a whole run (real broker, dora mode, emulated engine).

``dora-rl run --reward external`` starts no scorer; ``examples/reward_service.py``, run by an interpreter
that cannot import ``dora_rl`` (proved first), is an ordinary consumer group that scores the run's
trajectories exactly once. It is SIGKILLed once mid-run and started again; its reward hangs on one
prompt's trajectories, which it refuses to ``dora.dlq`` after its retry budget (DORA replaces that
group). The run finishes, the strict audit passes (nothing missing, nothing trained twice), every
consumed trajectory has exactly one committed output (scored or refused), and the assembler batches the
service's records exactly as the built-in scorer's: same key, partition, headers and rewards.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from clean_python import EXAMPLES, REPO, clean_python
from run_helpers import emulated_run, steps_done, wait_for

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=8, seed=11, max_new_tokens=64, emulated={"base_step_s": 0.02})
HANG_PROMPT = 3  # the reward hangs on this prompt's reference (p3's group is refused and replaced)

HANG_REWARD = '''
import time

def score(task, reference, completion):
    if reference == {ref!r}:
        time.sleep(60)
    if completion == reference:
        return 1.0
    if abs(len(completion) - len(reference)) > 0.5 * len(reference):
        return 0.0
    return 0.5 * sum(a == b for a, b in zip(completion, reference)) / max(len(reference), len(completion), 1)
'''


def _reference(task: str, seed: int, index: int) -> str:
    from dora_rl.core.tasks import get_task

    t, rng = get_task(task), random.Random(seed)
    return [t.sample(rng).reference for _ in range(index + 1)][index]


def _service(cmd: list[str], bootstrap: str, run_id: str, reward: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*cmd, str(EXAMPLES / "reward_service.py"), "--bootstrap-servers", bootstrap,
                             "--run-id", run_id, "--schemas", str(REPO / "dora_rl" / "schemas"),
                             "--reward-fn", f"{reward}:score", "--timeout-s", "1", "--max-attempts", "2",
                             *_key_args(run_id)],
                            stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def _key_args(run_id: str) -> list[str]:
    """The run's scorer key and token for the service (without them the run refuses its records)."""
    from dora_rl.roles import run_dir

    return ["--scorer-key-file", str(run_dir(run_id) / "scorer-key"), "--token-file",
            str(run_dir(run_id) / "weight-token")]


def _read(bootstrap: str, run_id: str, topic: str, cls: type) -> list[tuple[int, int, object, object]]:
    """(partition, offset, message, record) of the run's committed records on ``topic``."""
    from dora_rl.infra.kafka.runs import get_run, read_run

    out = []
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topic):
        rec = cls.decode(msg.value(), msg.headers())
        if getattr(rec, "run_id", None) == run_id:
            out.append((msg.partition(), msg.offset(), msg, rec))
    return out


def test_external_reward_service_killed_and_restarted_scores_the_run_exactly_once(
        bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from confluent_kafka import Consumer, TopicPartition

    from dora_rl.consumers.audit import audit_run
    from dora_rl.core.tasks import get_task
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import reader_config
    from dora_rl.infra.kafka.keys import make_key, partition_for
    from dora_rl.schemas.records import DeadLetter, TrainBatch, Trajectory

    py = clean_python(tmp_path)  # asserts that `import dora_rl` fails in it
    hang_ref = _reference("reverse", CONFIG["seed"], HANG_PROMPT)
    reward = tmp_path / "hang_reward.py"
    reward.write_text(HANG_REWARD.format(ref=hang_ref))
    cfg, out, log = tmp_path / "config.json", tmp_path / "summary.json", tmp_path / "reward-service.log"
    cfg.write_text(json.dumps(CONFIG))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    t0 = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg), "--json", str(out), "--quiet", "--reward", "external"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    services: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(lambda: runs.exists() and any((d / "pids.json").exists() for d in runs.iterdir()
                                               if d.name not in known), 120, "the roles")
        rdir = next(d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
        run_id = rdir.name
        assert not any(n.startswith("scorer") for n in json.loads((rdir / "pids.json").read_text())), \
            "--reward external still started the built-in scorer"
        services.append(_service(py, bootstrap, run_id, reward, log))

        def two_steps() -> bool:
            assert services[-1].poll() is None, log.read_text()[-3000:]
            return steps_done(bootstrap, run_id) >= 2

        wait_for(two_steps, 240, "two steps scored by the service")
        os.kill(services[0].pid, signal.SIGKILL)  # mid-run: a transaction may be open, a worker mid-call
        services[0].wait()
        services.append(_service(py, bootstrap, run_id, reward, log))
        code = launcher.wait(timeout=420)
        text = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, text[-3000:] + log.read_text()[-3000:]
        assert services[1].wait(timeout=60) == 0, log.read_text()[-3000:]  # it exits when the run is FINISHED
    finally:
        for p in (launcher, *services):
            if p.poll() is None:
                p.kill()
        for p in services:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its reward workers
            except ProcessLookupError:
                pass
    print(f"run with external reward service: {time.monotonic() - t0:.1f}s")
    assert json.loads(out.read_text())["steps"] == CONFIG["steps"]
    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
    assert report.c2_missing == 0
    refused = {g["group_id"].rsplit("/", 1)[1]: g for g in report.refused_groups}
    assert set(refused) == {f"p{HANG_PROMPT}"}, refused
    assert refused[f"p{HANG_PROMPT}"]["component"] == "reward-service"
    assert "timeout" in refused[f"p{HANG_PROMPT}"]["reason"]

    # exactly once: every trajectory record below the group's committed offsets has exactly one output
    generated = _read(bootstrap, run_id, topics.TRAJECTORIES, Trajectory)
    scored = _read(bootstrap, run_id, topics.SCORED, Trajectory)
    letters = [r for *_, r in _read(bootstrap, run_id, topics.DLQ, DeadLetter)
               if r.component == "reward-service" and r.source_topic == topics.TRAJECTORIES]
    consumer = Consumer(reader_config(bootstrap, f"dora.{run_id}.reward-service"))
    try:
        parts = {p for p, *_ in generated}
        committed = {tp.partition: tp.offset for tp in consumer.committed(
            [TopicPartition(topics.in_run(run_id, topics.TRAJECTORIES), p) for p in parts], timeout=30)}
    finally:
        consumer.close()
    consumed = Counter(t.trajectory_id for p, o, _, t in generated if o < committed[p])
    outputs = Counter(t.trajectory_id for *_, t in scored) + Counter(d.trajectory_id for d in letters)
    assert consumed and outputs == consumed, (consumed - outputs, outputs - consumed)
    assert Path(log).read_text().count("scoring run") == 2

    # the assembler treats them as the built-in scorer's: same wire format, key, partition, reward
    task = get_task("reverse")
    for part, _, msg, t in scored:
        assert msg.key() == make_key(int(t.policy_version), t.group_id).encode()
        assert part == partition_for(t.group_id, CONFIG.get("num_partitions", 4))
        assert dict(msg.headers()) == dict(t.encode()[1])
        assert t.reward == task.reward(t.reference, t.response_text) and t.scored_ms
    batched = [t for *_, b in _read(bootstrap, run_id, topics.BATCHES, TrainBatch) for t in b.trajectories]
    assert len(batched) == CONFIG["steps"] * CONFIG["train_batch_size"]
    assert all(t.reward == task.reward(t.reference, t.response_text) for t in batched)
    assert {t.trajectory_id for t in batched} <= set(outputs)
