"""The ``file`` weight transport, and the one Publisher/Fetcher path every transport shares (no broker)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dora_rl.infra.weights import (
    FetchStats,
    WeightFetchError,
    WeightManifest,
    make_weight_client,
    make_weight_server,
)
from dora_rl.infra.weights import sync as weight_sync
from dora_rl.infra.weights.file import bucket_path, index_path
from dora_rl.infra.weights.streams import split_buckets
from dora_rl.infra.weights.sync import Fetcher, Publisher
from dora_rl.schemas.records import PolicyVersion

TOKEN = "run-secret"
BUCKET = 64 << 10


def _ucx_available() -> bool:
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception:
        return False
    return True


KINDS = ["file", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(not _ucx_available(), reason="ucxx missing"))]


class Small(torch.nn.Module):
    """Several buckets at ``BUCKET`` bytes, a bf16 buffer, an int buffer and a tied pair."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(100, 128)  # 50 KiB
        self.proj = torch.nn.Linear(128, 128)
        self.head = torch.nn.Linear(128, 100, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.zeros(5, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.scale.copy_(torch.randn(5, generator=g))
            self.steps.copy_(torch.randint(0, 1 << 40, (3,), generator=g))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.fixture
def closing() -> Iterator[list[object]]:
    things: list[object] = []
    yield things
    for t in sorted(things, key=lambda t: not hasattr(t, "serve")):  # holders first
        t.close()  # type: ignore[attr-defined]


def _holder(directory: Path, closing: list[object], **kw: object):  # type: ignore[no-untyped-def]
    s = make_weight_server("file", TOKEN, directory=directory, bucket_bytes=BUCKET, **kw)  # type: ignore[arg-type]
    closing.append(s)
    return s


def _client(closing: list[object]):  # type: ignore[no-untyped-def]
    c = make_weight_client("file", TOKEN)
    closing.append(c)
    return c


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------- one path for every transport


@pytest.mark.parametrize("kind", KINDS)
def test_publisher_and_fetcher_share_one_path(kind: str, tmp_path: Path) -> None:
    trainer, instance = Small(1), Small(2)
    pub = Publisher(kind, "run-1", tmp_path, TOKEN, keep=2)
    fetcher = Fetcher(kind, TOKEN)
    try:
        ann = pub.publish(3, 7, trainer.state_dict(), {"loss": 0.5})
        assert (ann.version, ann.step, ann.transport, ann.holders) == (3, 7, kind, (pub.endpoint,))
        assert ann.announced_by == PolicyVersion.TRAINER and ann.train_metrics == {"loss": 0.5}
        assert ann.checksum_algo == "xxh3_64" and ann.tensors and ann.buckets
        ptr = instance.proj.weight.data_ptr()
        stats = fetcher.fetch_into(ann, instance)
        _same(dict(instance.state_dict()), dict(trainer.state_dict()))
        assert instance.proj.weight.data_ptr() == ptr  # in place
        assert instance.head.weight.data_ptr() == instance.embed.weight.data_ptr()
        assert type(stats) is FetchStats and stats.version == 3 and stats.gbps > 0
        assert stats.payload_bytes == ann.total_bytes and stats.holders == (pub.endpoint,)
        state, stats2 = fetcher.fetch_state(ann)  # fresh tensors
        _same(state, {k: v for k, v in trainer.state_dict().items() if k in state})
        assert set(state) == {t.name for t in ann.tensors} and stats2.version == 3
        pub.publish(4, 8, trainer.state_dict())
        pub.publish(5, 9, trainer.state_dict())  # keep=2: version 3 is retired
        with pytest.raises(WeightFetchError, match="does not hold version 3"):
            fetcher.fetch_into(ann, instance)
    finally:
        fetcher.close()
        pub.close()


def test_file_publisher_writes_under_run_dir_weights(tmp_path: Path) -> None:
    pub = Publisher("file", "run-1", tmp_path, TOKEN)
    try:
        ann = pub.publish(0, 0, Small(1).state_dict())
        assert ann.holders == (str(tmp_path / "weights"),)
        names = _files(tmp_path / "weights")
        assert names == sorted([index_path(Path(), 0).name] + [bucket_path(Path(), 0, b.index).name
                                                                for b in ann.buckets])
        assert [os.path.getsize(tmp_path / "weights" / bucket_path(Path(), 0, b.index).name)
                for b in ann.buckets] == [b.nbytes for b in ann.buckets]
    finally:
        pub.close()
    assert _files(tmp_path / "weights") == []  # closing the holder retires everything


def test_one_fetch_stats_type() -> None:
    assert weight_sync.FetchStats is FetchStats
    root = Path(weight_sync.__file__).resolve().parents[2]
    defs = {p.resolve().relative_to(root).as_posix()
            for d in ("infra", "producers", "consumers", "streams", "schemas", "dora_rl", "bench")
            for p in (root / d).rglob("*.py") if re.search(r"^class FetchStats\b", p.read_text(), re.M)}
    assert defs == {"infra/weights/fetcher.py"}


# ------------------------------------------------------------------------------------ file holders


def test_file_holder_needs_a_directory() -> None:
    with pytest.raises(ValueError, match="needs a directory"):
        make_weight_server("file", TOKEN)


def test_retire_removes_files_and_versions(tmp_path: Path, closing: list[object]) -> None:
    srv = _holder(tmp_path, closing)
    m1 = srv.serve(1, Small(1).state_dict())
    srv.serve(2, Small(2).state_dict())
    assert srv.versions == [1, 2] and srv.address == str(tmp_path)
    assert any(n.startswith("v0000000001.") for n in _files(tmp_path))
    assert srv.retire(1) and not srv.retire(1)
    assert not any(n.startswith("v0000000001.") for n in _files(tmp_path))
    assert srv.versions == [2]
    with pytest.raises(WeightFetchError, match="does not hold version 1"):
        _client(closing).fetch(m1, [srv.address])
    with pytest.raises(ValueError, match="already served"):
        srv.serve(2, Small(2).state_dict())


def test_buckets_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        closing: list[object]) -> None:
    srv = _holder(tmp_path, closing)
    real_replace = os.replace
    seen: list[tuple[str, int]] = []

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        assert not os.path.exists(dst), f"{dst} visible before its bytes were complete"
        assert Path(src).name.startswith("."), "written under a hidden temporary name"
        seen.append((Path(dst).name, os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    m = srv.serve(1, Small(1).state_dict())
    assert seen[-1][0] == index_path(Path(), 1).name  # the index goes last: then the version is listed
    assert seen[:-1] == [(bucket_path(Path(), 1, b.index).name, b.nbytes) for b in m.buckets]

    def fail_second_bucket(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).name == bucket_path(Path(), 2, 1).name:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second_bucket)
    with pytest.raises(OSError, match=r"cannot write .*v0000000002\.b000001\.bucket"):
        srv.serve(2, Small(2).state_dict())
    assert not any(n.startswith(("v0000000002.", ".")) for n in _files(tmp_path))  # nothing partial left
    assert srv.versions == [1]
    monkeypatch.setattr(os, "replace", real_replace)
    srv.serve(2, Small(2).state_dict())  # and the version can be published again
    assert srv.versions == [1, 2]


def test_corrupt_bucket_file_is_refused_with_a_clear_error(tmp_path: Path, closing: list[object]) -> None:
    srv = _holder(tmp_path, closing)
    m = srv.serve(4, Small(1).state_dict())
    assert len(m.buckets) >= 2
    path = bucket_path(tmp_path, 4, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    target = Small(2).state_dict()
    with pytest.raises(WeightFetchError, match=r"buckets \[1\] .*failed their checksum"):
        _client(closing).fetch(m, [srv.address], into=target)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_bad_bucket_file_is_fetched_from_the_second_holder(damage: str, tmp_path: Path,
                                                           closing: list[object]) -> None:
    sd = Small(1).state_dict()
    bad, good = _holder(tmp_path / "a", closing), _holder(tmp_path / "b", closing)
    m = bad.serve(4, sd)
    good.serve(4, sd)
    path = bucket_path(tmp_path / "a", 4, 1)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[7] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    target = Small(2).state_dict()
    cli = _client(closing)
    assert cli.fetch(m, [bad.address, good.address], into=target, probe_load=False) is target
    _same(target, dict(sd))
    s = cli.last_stats
    assert s is not None and s.holders == (bad.address, good.address) and bad.address in s.refused[0]
    expected = {"flip": "failed their checksum", "truncate": "100 bytes on disk", "delete": "gone"}[damage]
    assert expected in s.refused[0]
    # truncate / delete end the stream carrying bucket 1 there: it and the buckets after it in it
    (group,) = [g for g in split_buckets(m, list(range(len(m.buckets))), cli.streams) if 1 in g]
    assert s.refetched_buckets == (1 if damage == "flip" else sum(b >= 1 for b in group))


def test_wrong_version_is_refused(tmp_path: Path, closing: list[object]) -> None:
    srv = _holder(tmp_path, closing)
    m = srv.serve(3, Small(1).state_dict())
    other = WeightManifest.from_dict({**m.to_dict(), "version": 7})
    for probe in (True, False):
        with pytest.raises(WeightFetchError, match="version 7"):
            _client(closing).fetch(other, [srv.address], probe_load=probe)
    # files of version 3 put under version 7's names: the index says 3, the fetcher refuses it
    for b in m.buckets:
        os.link(bucket_path(tmp_path, 3, b.index), bucket_path(tmp_path, 7, b.index))
    os.link(index_path(tmp_path, 3), index_path(tmp_path, 7))
    with pytest.raises(WeightFetchError, match="answered with version 3 but version 7"):
        _client(closing).fetch(other, [srv.address])


def test_unreachable_directory_is_skipped(tmp_path: Path, closing: list[object]) -> None:
    sd = Small(1).state_dict()
    good = _holder(tmp_path / "good", closing)
    m = good.serve(1, sd)
    missing = str(tmp_path / "not-mounted")
    cli = _client(closing)
    _same(cli.fetch(m, [missing, good.address]), dict(sd))
    assert cli.last_stats is not None and "not a directory" in cli.last_stats.refused[0]
    with pytest.raises(WeightFetchError, match="not a directory"):
        cli.fetch(m, [missing])


def test_recycle_packs_into_the_last_written_buffers(tmp_path: Path, closing: list[object]) -> None:
    srv = _holder(tmp_path, closing, recycle=True)
    srv.serve(1, Small(1).state_dict())
    spare = srv._store._spare
    assert spare is not None
    ptrs = [b.ctypes.data for b in spare]
    sd2 = Small(2).state_dict()
    m2 = srv.serve(2, sd2)
    assert [b.ctypes.data for b in srv._store._spare] == ptrs  # packed into the same memory
    _same(_client(closing).fetch(m2, [srv.address]), dict(sd2))
