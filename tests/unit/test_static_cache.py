"""The torch engine's static KV cache mode: decode steps see a key width that changes rarely, and
sample exactly what the default (dynamic) mode samples.

Both modes run the same continuously batched call (requests of different prompt lengths and caps,
joins from the decode thread's callbacks into finished rows' slots and appended, a joiner wider than
the batch, trimming and compaction) with the same seed. Every uninitialised buffer is NaN-poisoned,
so a masked column the static mode fails to zero shows up as NaN logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dora_rl.modeling import encode_prompt
from dora_rl.producers.rollout import torch_batch as tb
from dora_rl.producers.rollout.engine import GenRequest, GenResult
from dora_rl.producers.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)

PROMPTS = ["abc=", "jihgfedcba=", "a=", "cafebabe=", "ddddddddddddddddddddddddddddd="]
ENGINE = "dora_rl.producers.rollout.torch_engine"


@pytest.fixture
def nan_poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``new_empty`` float tensor starts as NaN (what garbage memory may hold)."""
    real = torch.Tensor.new_empty

    def poisoned(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(self, *args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


def _req(tok, rid: str, prompt: str, max_new: int) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=encode_prompt(tok, prompt), max_new_tokens=max_new)


class _Probe:
    """Per decode step: the mask width and the key width the model sees; counts of the batch
    operations (``trims`` only those that dropped columns)."""

    def __init__(self, model, monkeypatch: pytest.MonkeyPatch) -> None:
        self.masks: list[int] = []
        self.keys: list[int] = []
        self.absorbs = self.trims = self.selects = 0
        self.handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)
        real_update = tb.SlackLayer.update

        def update(layer: tb.SlackLayer, k: torch.Tensor, v: torch.Tensor, *a: Any,
                   **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
            out = real_update(layer, k, v, *a, **kw)
            if k.shape[-2] == 1 and layer is self.first_layer:
                self.keys.append(out[0].shape[2])
            return out

        monkeypatch.setattr(tb.SlackLayer, "update", update)
        monkeypatch.setattr(f"{ENGINE}.absorb", self._wrap(tb.absorb, "absorbs"))
        monkeypatch.setattr(f"{ENGINE}.select", self._wrap(tb.select, "selects"))
        real_trim = tb.trim

        def trim(batch: tb.Batch, live: list[int]) -> None:
            width = batch.mask.shape[1]
            real_trim(batch, live)
            self.trims += batch.mask.shape[1] < width

        monkeypatch.setattr(f"{ENGINE}.trim", trim)
        self.first_layer: object = None

    def _pre(self, mod: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape[1] == 1:
            self.masks.append(kwargs["attention_mask"].shape[1])
            self.first_layer = kwargs["past_key_values"].layers[0]

    def _wrap(self, fn: Callable[..., tb.Batch], counter: str) -> Callable[..., tb.Batch]:
        def spy(*args: Any) -> tb.Batch:
            setattr(self, counter, getattr(self, counter) + 1)
            return fn(*args)
        return spy


def _run(model, tok, static: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[GenResult], _Probe]:
    """One continuously batched call: 5 rows, 8 queued requests refilling finished rows' slots (from
    ``on_finish``), a wide request and a pair joining at a fixed step (from ``on_chunk``)."""
    eng = TorchEngine(model, tok, eos_id=10**6, seed=3, static_cache=static)
    first = [_req(tok, f"r{i}", PROMPTS[i] * (1 + i % 2), max_new=5 + 9 * i) for i in range(5)]
    queue = [_req(tok, f"q{i}", PROMPTS[(2 * i) % 5] * (1 + i % 3), max_new=3 + 5 * (i % 4)) for i in range(8)]
    late = [_req(tok, "wide", PROMPTS[4] * 3, max_new=12), _req(tok, "p0", PROMPTS[3], max_new=20),
            _req(tok, "p1", PROMPTS[3], max_new=20)]
    cap = {q.request_id: q.max_new_tokens for q in first + queue + late}
    probe = _Probe(model, monkeypatch)
    seen = {"r4": 0}

    def on_chunk(rid: str, toks: list[int], lps: list[float]) -> None:
        if rid == "r4":
            seen["r4"] += 1
            if seen["r4"] == 9:
                assert eng.add(late)

    def on_finish(res: GenResult) -> None:
        if queue:
            assert eng.add([queue.pop(0)])

    try:
        results = eng.generate(first, on_chunk=on_chunk, chunk_tokens=1, on_finish=on_finish)
    finally:
        probe.handle.remove()
    assert sorted(r.request_id for r in results) == sorted(cap)
    assert all(len(r.token_ids) == cap[r.request_id] for r in results)
    return results, probe


@pytest.mark.parametrize("columns", [256, 8])
@pytest.mark.usefixtures("nan_poison")
def test_static_cache_samples_like_dynamic_with_few_key_widths(sharp_tiny, monkeypatch: pytest.MonkeyPatch,
                                                                columns: int) -> None:
    """Same tokens (and log-probs to 1e-5) in both modes; the static decode key width is a multiple of
    ``STATIC_COLUMNS`` equal to the mask's, takes few values, while the dynamic one grows every step.
    ``columns=8`` makes the window cross many multiples (buffer growth, trims across a multiple)."""
    model, tok = sharp_tiny
    monkeypatch.setattr(tb, "STATIC_COLUMNS", columns)
    with monkeypatch.context() as m:
        dyn, dprobe = _run(model, tok, False, m)
    with monkeypatch.context() as m:
        sta, sprobe = _run(model, tok, True, m)
    assert [r.request_id for r in sta] == [r.request_id for r in dyn]
    for d, s in zip(dyn, sta, strict=True):
        assert s.token_ids == d.token_ids, d.request_id
        assert max(abs(a - b) for a, b in zip(s.logprobs, d.logprobs, strict=True)) < 1e-5, d.request_id
        assert all(math.isfinite(x) for x in s.logprobs)
    for probe in (dprobe, sprobe):  # the batch mechanics ran: joins, trims that dropped columns, compaction
        assert probe.absorbs >= 3 and probe.trims >= 1 and probe.selects >= 1
        assert probe.keys == probe.masks and len(probe.masks) > 30
    steps = len(sprobe.masks)
    assert len(dprobe.masks) == steps
    assert len(set(dprobe.masks)) >= steps // 4  # the instrument sees the dynamic width move
    assert all(w % columns == 0 for w in sprobe.masks)
    distinct = len(set(sprobe.masks))
    assert distinct <= max(sprobe.masks) // columns
    if columns == 256:
        assert distinct * 4 < steps
    else:  # the window crossed several multiples: the growth and trim paths ran
        assert distinct >= 3


def test_static_layer_keeps_columns_past_the_window_zero(sharp_tiny) -> None:
    """The layer invariant directly: after prefill, joins (slot and appended, wider), trim, decode
    steps past buffer growth and compaction, every buffer column from the window's end is zero and
    the key width reported to the mask builder equals the width ``update`` returns."""
    model, _ = sharp_tiny
    seqs = [[1, *range(14, 20), 44], [1, 14, 44], [1, *range(14, 40), 44]]

    def check(batch: tb.Batch) -> None:
        for layer in batch.cache.layers:
            assert isinstance(layer, tb.SlackLayer) and layer.static
            kb, vb = layer._bufs()
            assert not kb[:, :, layer._e:].any() and not vb[:, :, layer._e:].any()
            assert layer.get_mask_sizes(1) == (tb.STATIC_COLUMNS * -(-(layer._e - layer._s + 1)
                                                                     // tb.STATIC_COLUMNS), 0)

    def step(batch: tb.Batch, n: int) -> None:
        for k in range(n):
            tb.feed(model, batch, torch.tensor([[17 + (b + k) % 9] for b in range(len(batch.rows))]))
            assert torch.isfinite(batch.logits).all()
            check(batch)

    with torch.no_grad():
        batch = tb.prefill(model, seqs[:2], [0, 1], 0, 8, static=True)  # chunked
        check(batch)
        step(batch, 3)
        batch = tb.absorb(batch, tb.prefill(model, [seqs[2], seqs[0]], [2, 3], 0, 4096, static=True), [1])
        check(batch)
        step(batch, 2)
        width = batch.mask.shape[1]
        tb.trim(batch, [0, 2])  # the widest row (1) finished
        assert batch.mask.shape[1] < width
        step(batch, 260)  # past the first multiple of STATIC_COLUMNS: the buffers grow
        batch = tb.select(batch, [0, 2])
        check(batch)
        step(batch, 2)
