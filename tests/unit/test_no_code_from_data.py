"""No code runs from data (issue 32, item 3): a checkpoint's ``trainer.pt`` holding a pickle that would run
code is loaded by no code path (the trainer's restore, ``replay retrain`` from a run or an archive), and a
restore reads only under the run's own checkpoint root, whatever location an announcement names."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.config import DoraConfig
from dora_rl.consumers.replay.retrain import available_checkpoints, retrain
from dora_rl.consumers.replay.source import RawRecord, by_version
from dora_rl.consumers.trainer import checkpoint
from dora_rl.consumers.trainer.session import start_session
from dora_rl.consumers.trainer.step import build_state, single_thread
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import PolicyVersion, RunInfo, TopicOffset, TrainBatch, Trajectory

CONFIG = DoraConfig.from_dict({"mode": "dora", "model": "tiny:1m", "train_batch_size": 2, "group_size": 2,
                               "rollout_batch_size": 2, "max_staleness": 1, "steps": 2, "weight_transport": "file"})


HOSTILE = r"Weights only load failed|Unsupported global"
"""What torch says when ``weights_only`` meets a pickle that names a callable."""


class Touch:
    """Unpickled, it creates ``marker``: what a hostile checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return pathlib.Path.touch, (self.marker,)


def _hostile_checkpoint(directory: Path, marker: Path) -> Path:
    """A complete checkpoint of version 0 with real weights and a ``trainer.pt`` that runs code when unpickled."""
    with single_thread():
        state = build_state(CONFIG)
        path = checkpoint.save_replayable(directory, 0, state.model, state.tokenizer, state.optimizer,
                                          state.lr_schedule, 0)
    torch.save({"optimizer": Touch(marker), "scheduler": {}, "step": 0, "version": 0}, path / "trainer.pt")
    return path


def test_the_hostile_pickle_would_run_code_if_unpickled(tmp_path: Path) -> None:
    """The fixture is live: loaded as a pickle, it creates the marker (so its absence below means something)."""
    path = _hostile_checkpoint(tmp_path / "ckpt", tmp_path / "marker")
    torch.load(path / "trainer.pt", weights_only=False)
    assert (tmp_path / "marker").exists()


def test_checkpoint_load_refuses_code_in_the_trainer_state(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = _hostile_checkpoint(tmp_path / "ckpt", marker)
    with single_thread():
        state = build_state(CONFIG)
        with pytest.raises(Exception, match=HOSTILE):
            checkpoint.load(path, state.model, state.optimizer, state.lr_schedule)
    assert not marker.exists()


def test_a_restore_reads_no_checkpoint_outside_the_runs_own_root(tmp_path: Path) -> None:
    """An announcement naming a checkpoint elsewhere (even a complete one) is refused before anything is read."""
    marker = tmp_path / "marker"
    elsewhere = _hostile_checkpoint(tmp_path / "elsewhere", marker)
    session = start_session(CONFIG, "r1", tmp_path / "run", "token", "i0")
    try:
        ann = session.announce(0, {})
        forged = {0: ann.replace(checkpoint_uri=str(elsewhere))}
        with pytest.raises(ValueError, match="outside this run's checkpoint root"):
            session.restore(forged)
        traversal = {0: ann.replace(checkpoint_uri=str(Path(str(ann.checkpoint_uri)) / ".." / ".." / ".." /
                                                   "elsewhere" / elsewhere.name))}
        with pytest.raises(ValueError, match="outside this run's checkpoint root"):
            session.restore(traversal)
    finally:
        session.publisher.close()
    assert not marker.exists()


class _Source:
    """A recorded run (as an archive holds it): one batch, one announcement, and its checkpoints directory."""

    def __init__(self, run_dir: Path, announced_uri: str) -> None:
        self.run_dir = run_dir
        self.info = RunInfo(run_id="src", state="FINISHED", mode="dora", config_json=CONFIG.to_json(), created_ms=0,
                            start_offsets=(TopicOffset(topic=topics.BATCHES, partition=0, offset=0),))
        traj = Trajectory(run_id="src", trajectory_id="t0", group_id="g0", prompt_id="g0", sample_index=0,
                          group_size=2, policy_version=0, task="reverse", reference="ab",
                          prompt_ids=np.array([5, 6, 7]), response_ids=np.arange(8, 11),
                          behaviour_logprobs=np.full(3, -1.0), response_text="ba", instance_version=0, reward=1.0)
        batch = TrainBatch(run_id="src", batch_id="src/step0", train_step=0, base_version=0, max_staleness=1,
                           created_ms=0, trajectories=(traj, traj.replace(trajectory_id="t1", sample_index=1)))
        self.ann = PolicyVersion(run_id="src", version=0, step=0, created_ms=0, transport="file", holders=(),
                                 total_bytes=0, checksum_algo="crc32", tensors=(), buckets=(),
                                 checkpoint_uri=announced_uri)
        self.records = {topics.RUNS: [self._raw(topics.RUNS, self.info, "run/src")],
                        topics.BATCHES: [self._raw(topics.BATCHES, batch, "src/step0")],
                        topics.VERSIONS: [self._raw(topics.VERSIONS, self.ann, "src/0")]}

    @staticmethod
    def _raw(topic: str, record: RunInfo | TrainBatch | PolicyVersion, key: str) -> RawRecord:
        value, headers = record.encode()
        return RawRecord(topic, 0, 0, key.encode(), value, tuple(headers), 1000)

    @property
    def where(self) -> str:
        return str(self.run_dir)

    def run_info(self) -> RunInfo:
        return self.info

    def raw(self, topic: str, version: int | None = None) -> Iterator[RawRecord]:
        return by_version(iter(self.records.get(topic, [])), version)

    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def test_replay_retrain_follows_no_announcement_outside_the_run_and_loads_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    elsewhere = _hostile_checkpoint(tmp_path / "elsewhere", marker)
    source = _Source(tmp_path / "archive", str(elsewhere))
    assert available_checkpoints(source, {0: source.ann}) == {}
    with pytest.raises(LookupError, match="checkpoint"):
        retrain(source, 0)  # the only checkpoint is outside the run: none to start from
    _hostile_checkpoint(source.checkpoints_dir(), marker)  # now one inside the archive, with code in it
    with pytest.raises(Exception, match=HOSTILE):
        retrain(source, 0)
    assert not marker.exists()



def test_run_and_weight_directories_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``file`` transport and the run's token rely on them: 0700, also where they existed wider."""
    from dora_rl.infra.weights.file import DirectoryStore
    from dora_rl.roles import run_dir

    monkeypatch.setenv("DORA_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "runs" / "old").mkdir(parents=True, mode=0o755)
    (tmp_path / "home" / "runs").chmod(0o755)
    for run in ("new", "old"):
        path = run_dir(run)
        assert path.stat().st_mode & 0o777 == 0o700 and path.parent.stat().st_mode & 0o777 == 0o700
    DirectoryStore(tmp_path / "weights")
    assert (tmp_path / "weights").stat().st_mode & 0o777 == 0o700
