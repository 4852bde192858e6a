"""Parallel streams of one fetch (dora_rl.infra.weights.fetcher / streams), over tcp and ucx, on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from channel_kinds import KINDS, NEEDS_UCX, TOKEN
from channel_kinds import transport_options as _options

from dora_rl.infra.weights import (
    FaultInjection,
    WeightFetchError,
    WeightManifest,
    make_weight_client,
    make_weight_server,
    pack_state_dict,
)
from dora_rl.infra.weights.holder import WeightServer
from dora_rl.infra.weights.streams import split_buckets

_NEEDS_UCX = NEEDS_UCX
MIB = 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    """8 direct tensors of 1 MiB (one bucket each at 1 MiB buckets), small ones, bf16, ints."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    sd["small"] = torch.randn(100, generator=g)
    sd["half"] = torch.randn(33, generator=g).to(torch.bfloat16)
    sd["steps"] = torch.randint(0, 1 << 40, (3,), generator=g)
    return sd


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for t in sorted(things, key=lambda t: not hasattr(t, "serve")):  # holders first
        t.close()


def _server(kind: str, closing: list[Any], **kw: Any) -> WeightServer:
    k, opts = _options(kind)
    s = make_weight_server(k, TOKEN, bucket_bytes=MIB, **opts, **kw)
    closing.append(s)
    return s


def _client(kind: str, closing: list[Any], streams: int) -> Any:
    k, opts = _options(kind)
    c = make_weight_client(k, TOKEN, streams=streams, **opts)
    closing.append(c)
    return c


def _bytes(m: WeightManifest, buckets: list[int]) -> int:
    return sum(m.buckets[b].nbytes for b in buckets)


# ------------------------------------------------------------------------------------------- split


def test_split_buckets_partitions_by_bytes() -> None:
    m, _ = pack_state_dict(_state(1), bucket_bytes=MIB)
    n = len(m.buckets)
    assert n >= 9
    for k in (1, 2, 3, n, n + 5):
        groups = split_buckets(m, list(range(n)), k)
        assert len(groups) == min(k, n)
        assert sorted(b for g in groups for b in g) == list(range(n))  # each bucket exactly once
        assert all(g == sorted(g) and g for g in groups)
        loads = [_bytes(m, g) for g in groups]
        assert max(loads) - min(loads) <= max(b.nbytes for b in m.buckets)  # balanced within a bucket
    assert split_buckets(m, [3, 5], 4) == [[3], [5]]  # fewer buckets than streams: fewer groups
    with pytest.raises(ValueError, match="streams"):
        make_weight_client("tcp", TOKEN, streams=0)


# ----------------------------------------------------------------------------------------- fetches


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streams", [2, 3])
def test_parallel_streams_are_bit_exact(kind: str, streams: int, closing: list[Any]) -> None:
    sd = _state(1)
    srv = _server(kind, closing)
    m = srv.serve(1, sd)
    cli = _client(kind, closing, streams)
    target = _state(2)
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    assert cli.fetch(m, [srv.address], into=target) is target
    _assert_bit_exact(target, sd)
    assert {k: v.data_ptr() for k, v in target.items()} == ptrs  # in place
    s = cli.last_stats
    assert s.holders == (srv.address,) and s.refused == () and s.refetched_buckets == 0
    assert s.bytes_received == s.payload_bytes == m.total_bytes and len(s.routes) == 1
    assert srv.bytes_sent == m.total_bytes and srv.transfers_done == streams  # one session per stream
    _assert_bit_exact(cli.fetch(m, [srv.address]), sd)  # fresh tensors, same client again
    assert srv.transfers_done == 2 * streams


@pytest.mark.parametrize("kind", KINDS)
def test_more_streams_than_buckets(kind: str, closing: list[Any]) -> None:
    sd = {"a": torch.randn(1000), "b": torch.randn(7)}
    srv = _server(kind, closing)
    m = srv.serve(1, sd)
    assert len(m.buckets) == 1
    cli = _client(kind, closing, 4)
    _assert_bit_exact(cli.fetch(m, [srv.address]), sd)
    assert srv.transfers_done == 1  # one bucket: one stream
    sd2 = _state(3)
    m2 = srv.serve(2, sd2)
    _assert_bit_exact(cli.fetch(m2, [srv.address], into=_state(4)), sd2)
    assert srv.transfers_done == 1 + 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("probe_load", [False, True])
def test_holder_killed_mid_fetch_rest_comes_from_another_holder(
    kind: str, probe_load: bool, closing: list[Any]
) -> None:
    sd = _state(1)
    bad, good = _server(kind, closing), _server(kind, closing)
    m = bad.serve(1, sd)
    good.serve(1, sd)
    killed: list[int] = []
    send_version = bad._send_version

    def dying(conn: Any, req: Any, held: Any) -> None:
        """The holder dies mid-stream in every session: half of its segments, then its sockets close
        (as the kernel closes a killed process's sockets: what was sent still arrives, then EOF)."""
        send_segments = conn.send_segments

        def half(bufs: Any) -> int:
            sent = send_segments(bufs[: max(1, len(bufs) // 2)])
            killed.append(len(bufs))
            conn.close()
            return sent

        conn.send_segments = half
        send_version(conn, req, held)

    bad._send_version = dying  # type: ignore[method-assign]
    cli = _client(kind, closing, 2)
    target = _state(2)
    cli.fetch(m, [bad.address, good.address], into=target, probe_load=probe_load)
    _assert_bit_exact(target, sd)
    s = cli.last_stats
    assert s.holders == (bad.address, good.address) and bad.address in s.refused[0]
    n = len(m.buckets)
    # at least the half each dying session never sent is fetched again (UCX may also lose a segment
    # in flight when the link drops: its receive never completes), at most what those sessions carried
    unsent = sum(k - max(1, k // 2) for k in killed)
    assert unsent <= s.refetched_buckets <= sum(killed) and 0 < s.refetched_buckets < n
    if probe_load:  # both idle: one stream each; the dead one's unfinished buckets went to `good`
        assert len(killed) == 1
    else:  # both streams on `bad`, both died halfway: the rest came from `good`
        assert len(killed) == 2 and good.bytes_sent < m.total_bytes and good.transfers_done >= 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streams", [2, 3])
def test_corrupt_bucket_is_refetched_with_streams(kind: str, streams: int, closing: list[Any]) -> None:
    sd = _state(1)
    bad = _server(kind, closing, faults=FaultInjection(corrupt_bucket=5))
    good = _server(kind, closing)
    m = bad.serve(1, sd)
    good.serve(1, sd)
    cli = _client(kind, closing, streams)
    out = cli.fetch(m, [bad.address, good.address], probe_load=False)
    _assert_bit_exact(out, sd)
    s = cli.last_stats
    assert s.refetched_buckets == 1 and s.holders == (bad.address, good.address)
    assert any("buckets [5] failed their checksum" in r for r in s.refused)
    assert good.bytes_sent == m.buckets[5].nbytes  # only the refused bucket came from `good`


@pytest.mark.parametrize("kind", KINDS)
def test_streams_spread_over_equally_idle_holders(kind: str, closing: list[Any]) -> None:
    sd = _state(1)
    a, b, busy = _server(kind, closing), _server(kind, closing), _server(kind, closing)
    m = a.serve(1, sd)
    b.serve(1, sd)
    busy.serve(1, sd)
    held = busy._store.acquire(1)
    try:
        cli = _client(kind, closing, 2)
        _assert_bit_exact(cli.fetch(m, [busy.address, a.address, b.address]), sd)
    finally:
        assert held is not None
        busy._store.release(held)
    s = cli.last_stats
    assert s.holders == (a.address, b.address) and busy.bytes_sent == 0
    groups = split_buckets(m, list(range(len(m.buckets))), 2)
    assert sorted([a.bytes_sent, b.bytes_sent]) == sorted(_bytes(m, g) for g in groups)


@pytest.mark.parametrize("kind", KINDS)
def test_every_stream_failing_names_what_is_missing(kind: str, closing: list[Any]) -> None:
    srv = _server(kind, closing, faults=FaultInjection(corrupt_bucket=2))
    m = srv.serve(1, _state(1))
    with pytest.raises(WeightFetchError, match=r"buckets \[2\] could not be fetched.*failed their checksum"):
        _client(kind, closing, 3).fetch(m, [srv.address])


# -------------------------------------------------------------------------------------- UCX lanes


@pytest.mark.parametrize("kind", [pytest.param("ucx", marks=_NEEDS_UCX), pytest.param("ucx-net", marks=_NEEDS_UCX)])
def test_ucx_fetcher_connections_receive_on_their_own_lanes(
    kind: str, monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    from dora_rl.infra.weights import ucx

    peers: list[bytes] = []
    original = ucx.UcxEngine.endpoint

    def spy(self: ucx.UcxEngine, address: bytes) -> object:
        peers.append(address)
        return original(self, address)

    monkeypatch.setattr(ucx.UcxEngine, "endpoint", spy)
    sd = _state(1)
    srv = _server(kind, closing)
    m = srv.serve(1, sd)
    cli = _client(kind, [], 2)
    _assert_bit_exact(cli.fetch(m, [srv.address]), sd)
    _assert_bit_exact(cli.fetch(m, [srv.address]), sd)
    t = cli._transport
    profile = "net" if kind == "ucx-net" else "local"
    assert cli.last_stats.routes[0].startswith(f"ucx/{profile} ")
    lanes = {t.engine(profile, i).address for i in range(t.fetcher_lanes(profile))}
    assert t.fetcher_lanes(profile) == 2 and len(lanes) == 2
    assert set(peers) == lanes  # the holder reached both fetcher workers of the profile, nothing else
    cli.close()
    assert len(srv._transport._eps) == 0  # `bye` named every lane: every cached endpoint closed
