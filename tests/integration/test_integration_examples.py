"""The three worked examples of docs/integration.md, run as documented (real broker, dora mode, emulated
engine), each by an interpreter that cannot import ``dora_rl``:

1. ``examples/reward_service.py`` scores a whole run started with ``--reward external``;
2. ``examples/jsonl_sink.py`` writes the run's scored trajectories to JSON lines, exactly once across a
   crash mid-write (cut file, restarted sink: byte-identical files);
3. ``examples/metrics_tail.py`` prints the run's metrics: the trainer's ``reward_mean`` per step equals the
   run's summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clean_python import EXAMPLES, REPO, clean_python
from run_helpers import emulated_run, wait_for

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=3, seed=12, max_new_tokens=48, emulated={"base_step_s": 0.02})


@pytest.fixture(scope="module")
def example_run(bootstrap: str, dora_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A finished run scored by the example reward service: its summary, the clean interpreter, a tmp dir."""
    tmp = tmp_path_factory.mktemp("examples")
    py = clean_python(tmp)
    cfg, out, log = tmp / "config.json", tmp / "summary.json", tmp / "reward-service.log"
    cfg.write_text(json.dumps(CONFIG))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg), "--json", str(out), "--quiet", "--reward", "external"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    service: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: runs.exists() and any(d.name not in known for d in runs.iterdir()), 120, "the run")
        run_id = next(d.name for d in runs.iterdir() if d.name not in known)
        # worked example 1, as in docs/integration.md (run from the repository root: default --schemas)
        service = subprocess.Popen([*py, str(EXAMPLES / "reward_service.py"), "--bootstrap-servers", bootstrap,
                                    "--run-id", run_id, "--scorer-key-file", str(runs / run_id / "scorer-key"),
                                    "--token-file", str(runs / run_id / "weight-token")], stdout=log.open("w"),
                                   stderr=subprocess.STDOUT, cwd=REPO,
                                   start_new_session=True)
        code = launcher.wait(timeout=300)
        text = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, text[-3000:] + log.read_text()[-3000:]
        assert service.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for p in (launcher, service):
            if p is not None and p.poll() is None:
                p.kill()
    yield {"summary": json.loads(out.read_text()), "py": py, "tmp": tmp, "run_id": run_id, "bootstrap": bootstrap}


def _scored(bootstrap: str, run_id: str) -> list[tuple[int, int, Any]]:
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import Trajectory

    out = []
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.SCORED):
        t = Trajectory.decode(msg.value(), msg.headers())
        if t.run_id == run_id:
            out.append((msg.partition(), msg.offset(), t))
    return out


def test_reward_service_example_scores_a_whole_run(example_run: dict[str, Any]) -> None:
    from dora_rl.consumers.audit import audit_run
    from dora_rl.core.tasks import get_task

    summary, run_id = example_run["summary"], example_run["run_id"]
    assert summary["steps"] == CONFIG["steps"]
    report = audit_run(example_run["bootstrap"], run_id)
    assert report.verdict == "PASS" and report.c2_missing == 0, report.render()
    scored = _scored(example_run["bootstrap"], run_id)
    assert len(scored) >= CONFIG["steps"] * CONFIG["train_batch_size"]
    task = get_task(CONFIG.get("task", "reverse"))
    assert all(t.reward == task.reward(t.reference, t.response_text) for *_, t in scored)


def test_jsonl_sink_example_writes_the_scored_trajectories_exactly_once(example_run: dict[str, Any]) -> None:
    run_id, tmp = example_run["run_id"], example_run["tmp"]
    lake = tmp / "lake"
    cmd = [*example_run["py"], str(EXAMPLES / "jsonl_sink.py"), "--bootstrap-servers", example_run["bootstrap"],
           "--run-id", run_id, "--out", str(lake), "--schemas", str(REPO / "dora_rl" / "schemas")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted((lake / run_id).glob("part-*.jsonl"))
    first = {f.name: f.read_bytes() for f in files}
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    scored = _scored(example_run["bootstrap"], run_id)
    assert sorted((r["_partition"], r["_offset"]) for r in rows) == sorted((p, o) for p, o, _ in scored)
    by_id = {t.trajectory_id: t for *_, t in scored}
    assert len(by_id) == len(rows)
    for r in rows:
        t = by_id[r["trajectory_id"]]
        assert r["reward"] == t.reward and r["response_text"] == t.response_text
        assert r["response_ids"] == t.response_ids.tolist()
        assert np.allclose(r["behaviour_logprobs"], t.behaviour_logprobs)
    # a crash mid-write: the biggest file loses its last lines and keeps half a line; restart, same bytes
    big = max(files, key=lambda f: len(f.read_bytes()))
    lines = big.read_bytes().splitlines(keepends=True)
    big.write_bytes(b"".join(lines[:len(lines) // 2]) + lines[len(lines) // 2][:20])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {f.name: f.read_bytes() for f in sorted((lake / run_id).glob("part-*.jsonl"))} == first


def test_metrics_tail_example_prints_the_run_metrics(example_run: dict[str, Any]) -> None:
    run_id = example_run["run_id"]
    base = [*example_run["py"], str(EXAMPLES / "metrics_tail.py"), "--bootstrap-servers", example_run["bootstrap"],
            "--run-id", run_id]
    res = subprocess.run([*base, "--component", "trainer", "--name", "reward_mean", "--json"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(line) for line in res.stdout.splitlines()]
    assert {m["run_id"] for m in metrics} == {run_id}
    by_step = {m["step"]: m["value"] for m in metrics}
    assert [by_step[s] for s in sorted(by_step)] == example_run["summary"]["reward_per_step"]
    res = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trainer/reward_mean step=0" in res.stdout and "reward-service/scored_total" in res.stdout


def test_faust_example_aggregates_the_runs_rewards_by_version(example_run: dict[str, Any]) -> None:
    """``examples/faust_reward_by_version.py`` (a Faust agent and table) over the finished run: its table holds
    every scored trajectory of the run once, with the first scored copy's reward, and its per-version means
    are those computed from the topic directly."""
    import asyncio
    import importlib.util
    import time
    import uuid

    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka import topics

    spec = importlib.util.spec_from_file_location("faust_reward_by_version", EXAMPLES / "faust_reward_by_version.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    bootstrap, run_id = example_run["bootstrap"], example_run["run_id"]
    first: dict[str, tuple[int, float]] = {}
    for _, _, t in sorted(_scored(bootstrap, run_id), key=lambda x: (x[0], x[1])):
        first.setdefault(t.trajectory_id, (int(t.policy_version), float(t.reward)))
    want = example.by_version(first.values())
    assert len(want) >= 2, "the run should span several versions"
    scored = topics.in_run(run_id, topics.SCORED)
    partitions = len(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics[scored]
                     .partitions)
    app, table = example.build_app(bootstrap, run_id, REPO / "schemas", partitions,
                                   app_id=f"faust-example-{uuid.uuid4().hex[:8]}", every_s=1.0)

    async def run() -> dict[str, list[Any]]:
        await app.start()
        try:
            deadline = time.monotonic() + 120
            while len(table) < len(first) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            return {k: list(v) for k, v in table.items()}
        finally:
            await app.stop()

    seen = asyncio.run(run())
    assert set(seen) == set(first), f"{len(seen)} of {len(first)} trajectories in the Faust table"
    assert {k: (v[0], v[1]) for k, v in seen.items()} == first
    assert example.by_version((v[0], v[1]) for v in seen.values()) == want
