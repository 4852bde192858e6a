"""The checkpoint root (``infra/storage.py``) on local disk and on an fsspec store without rename (``memory://``,
fsspec's own in-process filesystem): entries are whole or absent, reads stay under the root, pruning and a
zombie writer never touch another writer's marked entry; the trainer's checkpoints round-trip through both."""

from __future__ import annotations

import posixpath
import secrets
from pathlib import Path

import fsspec
import pytest
import torch

from dora_rl.config import DoraConfig
from dora_rl.config_checks import url_problem
from dora_rl.consumers.trainer import checkpoint
from dora_rl.infra.storage import COMPLETE, StorageRoot


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> StorageRoot:
    if request.param == "local":
        return StorageRoot(tmp_path / "ckpt")
    return StorageRoot(f"memory://bucket-{secrets.token_hex(4)}/run/trainer-state")


def test_an_entry_is_read_back_whole(root: StorageRoot) -> None:
    uri = root.write("v000001-a", {"model.safetensors": b"weights", "trainer.pt": b"state"})
    assert root.complete(uri)
    assert root.read(uri, "model.safetensors") == b"weights" and root.read(uri, "trainer.pt") == b"state"
    assert root.names() == ["v000001-a"]


def test_an_entry_without_its_marker_is_not_read(root: StorageRoot) -> None:
    """What a writer killed before its marker leaves behind (on a store: files, no marker)."""
    uri = root.entry("v000002-dead")
    root.fs.makedirs(root._path(uri), exist_ok=True)
    root.fs.pipe_file(f"{root._path(uri)}/model.safetensors", b"half")
    assert not root.complete(uri)
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        root.read(uri, "model.safetensors")


@pytest.mark.parametrize("outside", ["../other-run/trainer-state/v000001-a", "/v000001-a", "other/v1"])
def test_a_uri_outside_the_root_is_refused(root: StorageRoot, outside: str) -> None:
    root.write("v000001-a", {"x": b"1"})
    sneaky = root.url.rsplit("/", 1)[0] + "/" + outside if not outside.startswith("/") else outside
    with pytest.raises(ValueError, match="outside this run's checkpoint root"):
        root.read(sneaky, "x")
    with pytest.raises(ValueError, match="outside this run's checkpoint root"):
        root.within(root.url + "/../../elsewhere/v000001-a")


def test_a_local_root_refuses_a_store_url_and_a_store_root_a_local_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside"):
        StorageRoot(tmp_path).within("s3://bucket/run/trainer-state/v000001-a")
    with pytest.raises(ValueError, match="outside"):
        StorageRoot("memory://b/run").within(str(tmp_path / "v000001-a"))
    with pytest.raises(ValueError, match="outside"):  # another bucket with the same path
        StorageRoot("memory://b/run").within("s3://b/run/v000001-a")


def test_prune_removes_old_versions_of_every_incarnation_and_keeps_the_rest(root: StorageRoot) -> None:
    for name in ("v000001-a", "v000002-a", "v000002-b", "v000003-b"):
        root.write(name, {"x": name.encode()})
    checkpoint.prune(root, 3)
    assert root.names() == ["v000003-b"]


def test_prune_removes_a_fenced_writers_unmarked_entry(root: StorageRoot) -> None:
    """A zombie killed mid-write leaves files without the marker, possibly after the live trainer's last
    prune; readers ignore it and the next prune (a resumed run's) removes it with the other old versions."""
    path = root._path(root.entry("v000001-zombie"))
    if root.local:  # an object store has no directories: its files alone make the entry
        root.fs.makedirs(path, exist_ok=True)
    root.fs.pipe_file(posixpath.join(path, "model.safetensors"), b"half")
    root.write("v000003-b", {"x": b"live"})
    assert root.names() == ["v000001-zombie", "v000003-b"]
    assert not root.complete(root.entry("v000001-zombie"))
    checkpoint.prune(root, 3)
    assert root.names() == ["v000003-b"]


def test_a_zombie_writes_only_under_its_own_incarnation(root: StorageRoot) -> None:
    """The replacement announced v2 from incarnation b; the zombie a, still running, saves v2 too."""
    live = root.write("v000002-b", {"model.safetensors": b"live"})
    root.write("v000002-a", {"model.safetensors": b"zombie"})
    assert root.read(live, "model.safetensors") == b"live"


def test_entry_names_are_one_path_segment(root: StorageRoot) -> None:
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="one path segment"):
            root.write(bad, {"x": b""})
    with pytest.raises(ValueError, match="marker"):
        root.write("v1", {COMPLETE: b"forged"})


def _trainer(seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_a_trainer_checkpoint_round_trips(root: StorageRoot) -> None:
    model, opt, sched = _trainer(0)
    uri = checkpoint.save(root, 5, "inc1", model, opt, sched, step=5)
    assert uri == root.entry("v000005-inc1")
    other, oopt, osched = _trainer(1)
    assert checkpoint.load_from(root, uri, other, oopt, osched) == 5
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(),
                                                  strict=True))
    assert oopt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert osched.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]


def test_the_run_names_its_checkpoint_root(tmp_path: Path) -> None:
    from dora_rl.consumers.trainer.session import checkpoint_root

    local = checkpoint_root(DoraConfig(), "run-1", tmp_path)
    assert local.url == str((tmp_path / "trainer-state").resolve())
    shared = checkpoint_root(DoraConfig(checkpoint_url="memory://ckpts/dora/"), "run-1", tmp_path)
    assert shared.url == "memory://ckpts/dora/run-1/trainer-state"
    assert isinstance(shared.fs, type(fsspec.filesystem("memory")))


@pytest.mark.parametrize(("url", "problem"), [
    ("s3://bucket/dora", None), ("gs://b", None), ("memory://x/y", None),
    ("/data/ckpt", "must be a URL"), ("s3://", "must be a URL"),
    ("s3://key:secret@bucket/x", "credentials"), ("s3://bucket/../x", "'..'"),
])
def test_checkpoint_url_is_checked(url: str, problem: str | None) -> None:
    got = url_problem(url)
    assert (got is None) if problem is None else (got is not None and problem in got), got
    if problem is not None:
        with pytest.raises(ValueError, match="checkpoint_url"):
            DoraConfig(checkpoint_url=url).validate()
