"""Both instance-side ends of a KV move (``producers/rollout/kv_moves.py``) over a real TCP weight channel:
what is served, for how long, which references are followed, and why a resume is prefilled instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from channel_kinds import TOKEN

from dora_rl.infra.weights.channel import make_weight_server
from dora_rl.infra.weights.sync import Fetcher
from dora_rl.producers.rollout import kv_moves
from dora_rl.producers.rollout.engine import GenRequest
from dora_rl.producers.rollout.kv_rows import KvRows
from dora_rl.schemas.records import KvTransfer, RolloutRequest, TokenChunk


def _rows(n: int = 5) -> KvRows:
    g = torch.Generator().manual_seed(n)
    return KvRows(tuple(torch.randn(2, n, 4, generator=g) for _ in range(3)),
                  tuple(torch.randn(2, n, 4, generator=g) for _ in range(3)), torch.randn(11, generator=g))


def _request(rid: str, kv: KvTransfer | None) -> RolloutRequest:
    return RolloutRequest(run_id="r", trajectory_id=rid, group_id="r/p0", prompt_id="p0", sample_index=0, group_size=2,
                          policy_version=4, instance_id="rollout-1", action="GENERATE", task="t", reference="",
                          prompt_ids=np.array([1, 2]), partial_ids=np.array([7, 8, 9], dtype=np.int32),
                          partial_logprobs=np.full(3, -0.5, dtype=np.float32), max_new_tokens=8, kv=kv)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def holder():  # type: ignore[no-untyped-def]
    with make_weight_server("tcp", TOKEN) as server:
        yield server


@pytest.fixture()
def fetcher():  # type: ignore[no-untyped-def]
    f = Fetcher("tcp", TOKEN)
    yield f
    f.close()


def test_served_rows_arrive_bit_for_bit_and_survive_the_record(holder, fetcher) -> None:
    out = kv_moves.KvOutbox(holder, TOKEN)
    rows = _rows()
    kv = out.put("r/p0/1", rows)
    assert kv.transfer < 0 and kv.holder == holder.address and holder.versions == [kv.transfer]
    assert kv.signature == kv_moves.kv_signature(kv, TOKEN)
    # through both records' Avro encodings, as the orchestrator copies it from the chunk to the resume
    chunk = TokenChunk.decode(*TokenChunk(run_id="r", trajectory_id="r/p0/1", group_id="r/p0", policy_version=4,
                                          instance_id="rollout-0", start=0, token_ids=np.array([7, 8, 9]),
                                          logprobs=np.zeros(3), final=True, aborted=True, kv=kv).encode())
    req = RolloutRequest.decode(*_request("r/p0/1", chunk.kv).encode())
    got, why = kv_moves.fetch_rows(req, req.kv, TOKEN, fetcher.fetch_transfer)
    assert why == "" and got is not None
    for a, b in zip(got.keys + got.values + (got.logits,), rows.keys + rows.values + (rows.logits,), strict=True):
        assert torch.equal(a, b)


def test_only_a_reference_signed_by_the_run_is_followed(holder, fetcher) -> None:
    kv = kv_moves.KvOutbox(holder, TOKEN).put("r/p0/1", _rows())
    calls: list[KvTransfer] = []
    req = _request("r/p0/1", kv)
    for forged in (kv.replace(holder="10.9.9.9:1"),  # redirected elsewhere
                   kv.replace(signature=None),  # unsigned
                   kv.replace(signature=kv_moves.kv_signature(kv, "another-run"))):  # signed outside the run
        assert kv_moves.fetch_rows(req, forged, TOKEN, lambda k: calls.append(k) or {}) == (None, "signature")
    assert not calls  # no connection at all


def test_expired_gone_corrupt_or_foreign_rows_fall_back_to_a_prefill(holder, fetcher) -> None:
    clock = _Clock()
    out = kv_moves.KvOutbox(holder, TOKEN, clock)
    old = out.put("r/p0/1", _rows())
    clock.now = kv_moves.KV_HOLD_S + 1
    fresh = out.put("r/p0/2", _rows(6))
    assert holder.versions == [fresh.transfer] and out.held == 1  # the old one was retired on the way
    req = _request("r/p0/1", old)
    assert kv_moves.fetch_rows(req, old, TOKEN, fetcher.fetch_transfer) == (None, "fetch")
    # a run member's reference whose checksums are not the bytes served (signed, so the fetch is tried)
    wrong = fresh.replace(buckets=tuple(b.replace(checksum="0" * len(b.checksum)) for b in fresh.buckets))
    wrong = wrong.replace(signature=kv_moves.kv_signature(wrong, TOKEN))
    assert kv_moves.fetch_rows(req, wrong, TOKEN, fetcher.fetch_transfer) == (None, "fetch")
    # another trajectory's rows (a record naming the wrong transfer) are not this one's
    assert kv_moves.fetch_rows(req, fresh, TOKEN, fetcher.fetch_transfer) == (None, "format")
    assert kv_moves.fetch_rows(req, fresh, TOKEN, lambda k: {"w": torch.zeros(1)}) == (None, "format")


def test_the_outbox_holds_at_most_its_caps(holder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_moves, "KV_HOLD_MAX", 3)
    out = kv_moves.KvOutbox(holder, TOKEN)
    ids = [out.put(f"r/p0/{i}", _rows()).transfer for i in range(5)]
    assert sorted(holder.versions) == sorted(ids[-3:])
    out.expire()  # the age rule alone retires nothing young
    assert out.held == 3
    each = out.held_bytes // 3  # the same rows each time (packed with the channel's alignment)
    monkeypatch.setattr(kv_moves, "KV_HOLD_BYTES", 2 * each + 100)
    last = out.put("r/p0/9", _rows()).transfer
    assert sorted(holder.versions) == sorted([ids[-1], last])  # two fit the bytes


def test_the_inbox_counts_every_request_that_names_rows(holder, fetcher) -> None:
    kv = kv_moves.KvOutbox(holder, TOKEN).put("r/p0/1", _rows())
    counted: list[tuple[str, int, str]] = []
    inbox = kv_moves.KvInbox(fetcher.fetch_transfer, TOKEN, lambda name, v, why: counted.append((name, v, why)))
    plain = GenRequest(request_id="r/p0/1", prompt_ids=[1, 2], partial_ids=[7, 8, 9], partial_logprobs=[-0.5] * 3,
                       max_new_tokens=8)
    assert inbox.with_rows(_request("r/p0/1", None), plain) is plain and not counted
    assert inbox.with_rows(_request("r/p0/1", kv), plain).kv is not None
    assert inbox.with_rows(_request("r/p0/1", kv.replace(holder="10.9.9.9:1")), plain).kv is None
    assert counted == [("kv_moves", 4, ""), ("kv_fallback", 4, "signature")]


_BUILD_ONLY = """
import sys
from dora_rl.producers.rollout import kv_moves
ROWS = "dora_rl.producers.rollout.kv_rows"
assert ROWS not in sys.modules, "imported before any outbox or inbox exists"
kv_moves.{end}
loading = kv_moves.load_rows_module()
assert loading.is_alive(), "the {end} waited for the import: every restart would wait with it"
loading.join(120)
assert getattr(sys.modules.get(ROWS), "from_tensors", None), "the {end} left the rows module to its first move"
"""


@pytest.mark.parametrize("end", ["KvOutbox(server=None, token='t')", "KvInbox(lambda *a: None, 't', lambda *a: None)"])
def test_building_either_end_loads_the_rows_module_before_the_first_move(end: str) -> None:
    """The rows module imports transformers (~4 s on 2 cores): imported at the first export, it stalled the
    generation thread mid-step and every move of that run's first re-partition (decision 0077); imported before
    the instance serves, it lengthened every restart (decision 0078): it is loaded beside the instance's start."""
    import subprocess
    import sys

    code = _BUILD_ONLY.format(end=end)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
