"""The out-of-band weight channel (dora_rl.infra.weights) over both transports, on loopback."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import itertools

from channel_kinds import KINDS, NEEDS_UCX, TOKEN
from channel_kinds import transport_options as _options

from dora_rl.infra.weights import (
    FaultInjection,
    TransportUnavailableError,
    WeightFetchError,
    WeightManifest,
    make_weight_client,
    make_weight_server,
    pack_state_dict,
    unpack_into,
)
from dora_rl.infra.weights.manifest import ALIGN
from dora_rl.infra.weights.plan import DIRECT_MIN, bucket_segments
from dora_rl.infra.weights.streams import split_buckets

_NEEDS_UCX = NEEDS_UCX


class TinyLM(torch.nn.Module):
    """Small model with every case: big (direct) and small (bounce) tensors, bf16, ints, a tied pair."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(300, 256)  # 300 KiB fp32: direct segment
        self.ln = torch.nn.LayerNorm(256)
        self.proj = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 300, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.zeros(7, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.scale.copy_(torch.randn(7, generator=g))
            self.steps.copy_(torch.randint(0, 1 << 40, (3,), generator=g))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def closing() -> Iterator[list[object]]:
    things: list[object] = []
    yield things
    # holders first, while their fetchers still live (a holder's cached UCX endpoints flush on close)
    for t in sorted(things, key=lambda t: not hasattr(t, "serve")):
        t.close()  # type: ignore[attr-defined]


def _server(kind: str, closing: list[object], **kw: object):  # type: ignore[no-untyped-def]
    k, opts = _options(kind)
    s = make_weight_server(k, TOKEN, bucket_bytes=256 << 10, **opts, **kw)  # type: ignore[arg-type]
    closing.append(s)
    return s


def _client(kind: str, closing: list[object], token: str = TOKEN):  # type: ignore[no-untyped-def]
    k, opts = _options(kind)
    c = make_weight_client(k, token, **opts)
    closing.append(c)
    return c


# ------------------------------------------------------------------------------------------ manifest


def test_pack_layout_and_dict_round_trip() -> None:
    sd = TinyLM(1).state_dict()
    m, buckets = pack_state_dict(sd, bucket_bytes=256 << 10, version=5)
    assert m.version == 5 and len(m.buckets) >= 2
    assert all(t.offset % ALIGN == 0 for t in m.tensors)
    tied = {t.name: (t.bucket, t.offset) for t in m.tensors}
    assert tied["head.weight"] == tied["embed.weight"]  # stored once
    assert m.total_bytes == sum(b.nbytes for b in buckets)
    assert WeightManifest.from_dict(m.to_dict()) == m
    # every bucket is tiled by its segments, in order
    for b in range(len(m.buckets)):
        segs = bucket_segments(m, b)
        assert segs[0].start == 0 and segs[-1].end == m.buckets[b].nbytes
        assert all(x.end == y.start for x, y in itertools.pairwise(segs))
    assert any(s.direct for b in range(len(m.buckets)) for s in bucket_segments(m, b))
    views = unpack_into(m, buckets, None)
    _assert_bit_exact(views, dict(sd))
    target = TinyLM(2).state_dict()
    assert unpack_into(m, buckets, target) is target
    _assert_bit_exact(target, dict(sd))


def test_unpack_refuses_corrupt_bucket_and_broken_manifest() -> None:
    m, buckets = pack_state_dict(TinyLM(1).state_dict(), bucket_bytes=256 << 10)
    buckets[0][10] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        unpack_into(m, buckets, None)
    d = m.to_dict()
    d["tensors"][0]["offset"] = 3
    with pytest.raises(ValueError, match="unaligned"):
        WeightManifest.from_dict(d)


# ------------------------------------------------------------------------------------------ channel


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_bit_exact_into_existing_model(kind: str, closing: list[object]) -> None:
    trainer, instance = TinyLM(1), TinyLM(2)
    srv = _server(kind, closing)
    m = srv.serve(3, trainer.state_dict())
    assert len(m.buckets) >= 2
    target = instance.state_dict()
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    stats = []
    cli = _client(kind, closing)
    out = cli.fetch(m, [srv.address], into=target, on_stats=stats.append)
    assert out is target
    _assert_bit_exact(dict(instance.state_dict()), dict(trainer.state_dict()))
    assert {k: v.data_ptr() for k, v in instance.state_dict().items()} == ptrs  # written in place
    assert instance.head.weight.data_ptr() == instance.embed.weight.data_ptr()
    (s,) = stats
    assert s.version == 3 and s.kind == _options(kind)[0] and s.payload_bytes == m.total_bytes and s.gbps > 0
    assert srv.bytes_sent == m.total_bytes and srv.transfers_done == min(cli.streams, len(m.buckets))
    _eventually(lambda: srv.active_transfers == 0)  # released by the session thread after the trailer


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_without_target_gives_fresh_tensors(kind: str, closing: list[object]) -> None:
    sd = TinyLM(1).state_dict()
    srv = _server(kind, closing)
    m = srv.serve(1, sd)
    out, buckets = _client(kind, closing).fetch_packed(m, [srv.address])
    _assert_bit_exact(out, dict(sd))
    peer = _server(kind, closing)  # peer-to-peer: re-serve what was fetched, no copy
    peer.serve_packed(m, buckets, verify=True)
    _assert_bit_exact(_client(kind, closing).fetch(m, [peer.address]), dict(sd))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["corrupt_bucket", "die_in_bucket"])
def test_bad_bucket_is_refused_and_refetched_from_second_holder(
    kind: str, fault: str, closing: list[object]
) -> None:
    sd = TinyLM(1).state_dict()
    bad = _server(kind, closing, faults=FaultInjection(**{fault: 1}))
    good = _server(kind, closing)
    m = bad.serve(4, sd)
    good.serve(4, sd)
    target = TinyLM(2).state_dict()
    cli = _client(kind, closing)
    cli.fetch(m, [bad.address, good.address], into=target, probe_load=False)
    _assert_bit_exact(target, dict(sd))
    s = cli.last_stats
    assert s is not None and s.holders == (bad.address, good.address)
    assert s.refused and bad.address in s.refused[0]
    if fault == "corrupt_bucket":
        assert "checksum" in s.refused[0]
        assert s.refetched_buckets == 1
        assert good.bytes_sent == m.buckets[1].nbytes  # only the refused bucket came from `good`
    else:  # the stream carrying bucket 1 died in it: it and the buckets after it in that stream
        (group,) = [g for g in split_buckets(m, list(range(len(m.buckets))), cli.streams) if 1 in g]
        assert s.refetched_buckets == sum(b >= 1 for b in group)


@pytest.mark.parametrize("kind", KINDS)
def test_single_corrupt_holder_raises_clear_error(kind: str, closing: list[object]) -> None:
    srv = _server(kind, closing, faults=FaultInjection(corrupt_bucket=0))
    m = srv.serve(2, TinyLM(1).state_dict())
    with pytest.raises(WeightFetchError, match=r"buckets \[0\].*failed their checksum"):
        _client(kind, closing).fetch(m, [srv.address], into=TinyLM(2).state_dict())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("probe_load", [True, False])
def test_wrong_token_refused_without_weight_bytes(kind: str, probe_load: bool, closing: list[object]) -> None:
    srv = _server(kind, closing)
    m = srv.serve(1, TinyLM(1).state_dict())
    target = TinyLM(2).state_dict()
    before = {k: v.clone() for k, v in target.items()}
    cli = _client(kind, closing, token="not-the-run-token")
    with pytest.raises(WeightFetchError, match="unauthorized: wrong token"):
        cli.fetch(m, [srv.address], into=target, probe_load=probe_load)
    assert srv.bytes_sent == 0 and srv.refusals >= 1 and srv.active_transfers == 0
    _assert_bit_exact(target, before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("probe_load", [True, False])
def test_version_not_held_is_refused(kind: str, probe_load: bool, closing: list[object]) -> None:
    srv = _server(kind, closing)
    m = srv.serve(3, TinyLM(1).state_dict())
    other = WeightManifest.from_dict({**m.to_dict(), "version": 7})
    with pytest.raises(WeightFetchError, match="version 7"):
        _client(kind, closing).fetch(other, [srv.address], probe_load=probe_load)
    assert srv.bytes_sent == 0


@pytest.mark.parametrize("kind", KINDS)
def test_holder_answering_another_version_is_refused(kind: str, closing: list[object]) -> None:
    srv = _server(kind, closing, faults=FaultInjection(answer_version=9))
    m = srv.serve(3, TinyLM(1).state_dict())
    with pytest.raises(WeightFetchError, match="answered with version 9 but version 3"):
        _client(kind, closing).fetch(m, [srv.address])


@pytest.mark.parametrize("kind", KINDS)
def test_retire_frees_the_version(kind: str, closing: list[object]) -> None:
    srv = _server(kind, closing)
    m1 = srv.serve(1, TinyLM(1).state_dict())
    srv.serve(2, TinyLM(2).state_dict())
    held = srv._store.acquire(1)
    assert held is not None
    refs = [weakref.ref(b) for b in held.buckets]
    srv._store.release(held)
    del held
    assert srv.retire(1) and not srv.retire(1)
    gc.collect()
    assert all(r() is None for r in refs)  # memory released
    assert srv.versions == [2]
    with pytest.raises(WeightFetchError, match="does not hold version 1"):
        _client(kind, closing).fetch(m1, [srv.address])


@pytest.mark.parametrize("kind", KINDS)
def test_least_loaded_holder_is_tried_first(kind: str, closing: list[object]) -> None:
    sd = TinyLM(1).state_dict()
    busy, idle = _server(kind, closing), _server(kind, closing)
    m = busy.serve(1, sd)
    idle.serve(1, sd)
    held = busy._store.acquire(1)  # one transfer in progress on `busy`
    try:
        cli = _client(kind, closing)
        assert cli.rank([busy.address, idle.address], 1)[0] == [idle.address, busy.address]
        cli.fetch(m, [busy.address, idle.address])
        assert cli.last_stats is not None and cli.last_stats.holders == (idle.address,)
        assert busy.bytes_sent == 0
    finally:
        assert held is not None
        busy._store.release(held)


def test_dead_holder_address_is_skipped(closing: list[object]) -> None:
    sd = TinyLM(1).state_dict()
    dead = _server("tcp", [])
    dead_addr = dead.address
    dead.close()
    good = _server("tcp", closing)
    m = good.serve(1, sd)
    cli = _client("tcp", closing)
    _assert_bit_exact(cli.fetch(m, [dead_addr, good.address], probe_load=False), dict(sd))
    assert cli.last_stats is not None and dead_addr in cli.last_stats.refused[0]


def test_ucx_unavailable_raises_and_names_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ucxx", None)
    monkeypatch.setitem(sys.modules, "ucxx._lib.libucxx", None)
    with pytest.raises(TransportUnavailableError, match='set the weight transport to "tcp"'):
        make_weight_server("ucx", TOKEN)
    with pytest.raises(TransportUnavailableError, match='"tcp"'):
        make_weight_client("ucx", TOKEN)
    with pytest.raises(ValueError, match="unknown weight transport"):
        make_weight_client("carrier-pigeon", TOKEN)
    make_weight_client("tcp", TOKEN).close()  # tcp needs nothing else


def test_direct_min_is_exercised() -> None:
    m, _ = pack_state_dict(TinyLM(1).state_dict(), bucket_bytes=256 << 10)
    assert any(t.nbytes >= DIRECT_MIN for t in m.tensors)
    assert any(t.nbytes < DIRECT_MIN for t in m.tensors)


@_NEEDS_UCX
def test_ucx_same_host_profile_only_for_same_host(
    monkeypatch: pytest.MonkeyPatch, closing: list[object]
) -> None:
    from dora_rl.infra.weights import ucx

    used: list[str] = []
    original = ucx.UcxEngine.endpoint

    def spy(self: ucx.UcxEngine, address: bytes) -> object:
        used.append(self.profile)
        return original(self, address)

    monkeypatch.setattr(ucx.UcxEngine, "endpoint", spy)
    sd = TinyLM(1).state_dict()
    srv = _server("ucx", closing)
    m = srv.serve(1, sd)
    cli = _client("ucx", closing)
    _assert_bit_exact(cli.fetch(m, [srv.address]), dict(sd))
    cli._transport.host = "another-host"  # type: ignore[attr-defined]
    _assert_bit_exact(cli.fetch(m, [srv.address]), dict(sd))
    k = used.count("local")  # an endpoint per (holder lane, fetcher lane) pair: local ones, then net
    assert 0 < k < len(used) and used == ["local"] * k + ["net"] * (len(used) - k)


@pytest.mark.parametrize("kind", KINDS)
def test_fetcher_vanishing_mid_transfer_does_not_wedge_the_holder(kind: str, closing: list[object]) -> None:
    from dora_rl.infra.weights.protocol import PROTO, credentials

    big = {f"w{i}": torch.randn(1024, 1024) for i in range(8)}  # 32 MiB: more than socket buffers hold
    srv = _server(kind, closing)
    m = srv.serve(1, big)
    transport = _client(kind, closing)._transport
    conn = transport.connect(srv.address)
    req = {
        "proto": PROTO,
        **credentials(TOKEN),
        "op": "fetch",
        "version": 1,
        "buckets": list(range(len(m.buckets))),
    }
    conn.send_msg({**req, **conn.request_extras()})
    assert conn.recv_msg()["ok"]
    conn.send_msg({"go": True})  # the holder starts streaming; this fetcher never reads
    deadline = time.monotonic() + 10
    while srv.active_transfers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.abort()  # the fetcher dies without reading the segments
    t0 = time.monotonic()
    while srv.active_transfers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.active_transfers == 0 and time.monotonic() - t0 < 5  # noticed at once, not at the I/O timeout
    assert srv.transfers_done == 0
    out = _client(kind, closing).fetch(m, [srv.address])  # and it still serves
    _assert_bit_exact(out, big)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "tcp"])
def test_ucx_holder_drops_cached_endpoints_when_fetcher_says_bye(kind: str, closing: list[object]) -> None:
    srv = _server(kind, closing)
    m = srv.serve(1, TinyLM(1).state_dict())
    cli = _client(kind, [])
    cli.fetch(m, [srv.address])
    cli.fetch(m, [srv.address])
    profile = "net" if kind == "ucx-net" else "local"
    pairs = srv._transport.lanes(profile) * cli._transport.fetcher_lanes(profile)  # type: ignore[attr-defined]
    assert 1 <= len(srv._transport._eps) <= pairs  # type: ignore[attr-defined]  # one per lane pair, reused
    cli.close()
    assert len(srv._transport._eps) == 0  # type: ignore[attr-defined]


def test_recycle_packs_into_the_retired_version_buffers(closing: list[object]) -> None:
    srv = _server("tcp", closing, recycle=True)
    srv.serve(1, TinyLM(1).state_dict())
    held = srv._store.acquire(1)
    assert held is not None
    ptrs = [b.ctypes.data for b in held.buckets]
    srv._store.release(held)
    srv.retire(1)
    assert srv._store._spare is not None  # kept for reuse, not freed
    sd2 = TinyLM(2).state_dict()
    m2 = srv.serve(2, sd2)
    assert srv._store._spare is None  # taken by the new version
    held2 = srv._store.acquire(2)
    assert held2 is not None
    srv._store.release(held2)
    assert [b.ctypes.data for b in held2.buckets] == ptrs  # same memory, no fresh page faults
    _assert_bit_exact(_client("tcp", closing).fetch(m2, [srv.address]), dict(sd2))


def test_idle_oversized_and_trickling_peers_cost_a_holder_bounded_sessions(closing: list[object]) -> None:
    """300 idle connections, a header announcing a 16 MiB request, and a peer sending a byte every 0.3 s: the
    holder runs at most ``max_sessions`` sessions, refuses the oversized header at once (before any allocation
    or token check), drops the trickle at the request deadline, and a real fetch completes afterwards."""
    import socket

    from dora_rl.infra.weights.protocol import MAGIC

    srv = make_weight_server("tcp", TOKEN, bucket_bytes=256 << 10, max_sessions=16, request_deadline_s=1.0)
    closing.append(srv)
    m = srv.serve(1, TinyLM(1).state_dict())
    host, port = srv.address.rsplit(":", 1)

    def sessions() -> int:
        return sum(t.name == "weights-tcp-conn" for t in threading.enumerate())

    idle: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            idle.append(s)
        time.sleep(0.5)
        assert 0 < sessions() <= 16
        for s in idle:
            s.close()
        idle.clear()
        _eventually(lambda: sessions() == 0, 10.0)
        big = socket.create_connection((host, int(port)), timeout=5)
        big.sendall(MAGIC + (16 << 20).to_bytes(4, "big"))
        t0 = time.monotonic()
        assert big.recv(1) == b"" and time.monotonic() - t0 < 0.5  # closed at once, nothing sent
        big.close()
        trickle = socket.create_connection((host, int(port)), timeout=5)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for b in MAGIC + (100).to_bytes(4, "big") + b"{" * 100:
                trickle.send(bytes([b]))
                time.sleep(0.3)
        assert time.monotonic() - t0 < 3.0  # dropped at the 1 s deadline, not after 100 x 0.3 s
        trickle.close()
    finally:
        for s in idle:
            s.close()
    cli = _client("tcp", closing)
    out = cli.fetch(m, [srv.address])
    _assert_bit_exact(out, dict(TinyLM(1).state_dict()))


def _crc32_keeping_rewrite(buf: np.ndarray, at: int, evil: bytes, patch_at: int) -> None:
    """Write ``evil`` at ``at`` in ``buf`` and 4 bytes at ``patch_at`` so that its crc32 is unchanged (crc32 is
    affine over GF(2): the 32 single-bit flips of the patch span every crc difference)."""
    import zlib

    n, zero = buf.nbytes, zlib.crc32(bytes(buf.nbytes))

    def image(diff: dict[int, int]) -> int:  # the crc difference a byte-wise xor ``diff`` makes
        d = bytearray(n)
        for i, v in diff.items():
            d[i] = v
        return zlib.crc32(bytes(d)) ^ zero

    before = zlib.crc32(buf.tobytes())
    target = image({at + i: buf[at + i] ^ b for i, b in enumerate(evil)})
    rows = [(image({patch_at + k // 8: 1 << (k % 8)}), 1 << k) for k in range(32)]  # (crc image, patch bits)
    pivots: list[tuple[int, int]] = []
    for img, bits in rows:  # Gaussian elimination over GF(2), one pivot per leading crc bit
        for p_img, p_bits in pivots:
            if img ^ p_img < img:
                img, bits = img ^ p_img, bits ^ p_bits
        if img:
            pivots.append((img, bits))
    pivots.sort(reverse=True)
    solution = 0
    for p_img, p_bits in pivots:
        if target ^ p_img < target:
            target, solution = target ^ p_img, solution ^ p_bits
    assert target == 0, "crc32 patch not found"
    buf[at:at + len(evil)] = np.frombuffer(evil, dtype=np.uint8)
    for i in range(4):
        buf[patch_at + i] ^= (solution >> (8 * i)) & 0xFF
    assert zlib.crc32(buf.tobytes()) == before


@pytest.mark.parametrize(("algo", "refused"), [("crc32", False), ("blake2b", True)])
def test_a_bucket_rewritten_to_keep_its_crc32_is_refused_only_under_the_authenticated_digest(
    algo: str, refused: bool, closing: list[object]
) -> None:
    """A holder (a compromised peer, or anyone on the path) rewrites a bucket so that its crc32 still matches
    the signed announcement: crc32 lets it through (the attack is real), blake2b refuses it."""
    model = TinyLM(1)
    srv = make_weight_server("tcp", TOKEN, bucket_bytes=256 << 10, checksum_algo=algo)
    closing.append(srv)
    m = srv.serve(1, model.state_dict())
    assert m.checksum_algo == algo
    held = srv._store.acquire(1)
    assert held is not None
    largest = max(held.buckets, key=lambda b: b.nbytes)
    _crc32_keeping_rewrite(largest, 4096, b"EVIL" * 4, 8192)
    srv._store.release(held)
    cli = _client("tcp", closing)
    if refused:
        with pytest.raises(WeightFetchError, match=r"checksum|corrupt|refused"):
            cli.fetch(m, [srv.address])
    else:
        out = cli.fetch(m, [srv.address])
        assert any(not torch.equal(_bits(out[k]), _bits(v)) for k, v in model.state_dict().items())


def test_the_run_token_never_travels_on_the_weight_channel(closing: list[object]) -> None:
    """A fetcher proves it knows the token (HMAC of a fresh nonce); what a listener on the path sees holds no
    token, and a proof made with another token is refused."""
    import socket

    from dora_rl.infra.weights.protocol import authorized, credentials

    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def eavesdrop() -> None:
        conn, _ = listener.accept()
        with conn:  # one request, then hang up: the fetcher gives up on this holder
            conn.settimeout(5)
            seen.append(conn.recv(65536))

    t = threading.Thread(target=eavesdrop, daemon=True)
    t.start()
    cli = _client("tcp", closing)
    with pytest.raises(WeightFetchError):
        cli.fetch(_server("tcp", closing).serve(1, TinyLM(1).state_dict()),
                  [f"127.0.0.1:{listener.getsockname()[1]}"])
    t.join(10)
    listener.close()
    wire = b"".join(seen)
    assert b"proof" in wire and TOKEN.encode() not in wire
    assert authorized(TOKEN, credentials(TOKEN)) and not authorized(TOKEN, credentials("another-token"))
