"""The running decode batch of :class:`~.torch_engine.TorchEngine`: rows, KV cache, mask, positions.

A :class:`Batch` is in one state between decode steps: its KV cache holds every token fed so far,
``logits`` are each row's next-token logits, ``mask`` (``[B, W]``, ``W`` = the cache length) is 1 on
real tokens and 0 on left padding, ``last_pos`` (``[B, 1]``) is the position of each row's last token.
Positions are explicit (``cumsum(mask) - 1``), never derived from a column index, so a row's
computation does not depend on its padding or on the other rows: rows can take the slots of finished
rows or be appended (:func:`absorb`, continuous batching), be dropped (:func:`select`) and leading
all-padding columns trimmed (:func:`trim`) between steps, and every row continues exactly as if it
had been decoded alone (padding columns are masked out; keys are cached after the rotary embedding,
so a row's columns may move).

The cache layers are :class:`SlackLayer`: buffers with spare rows and columns, so a decode step
writes one column in place instead of copying the whole cache (``DynamicLayer`` concatenates every
step: most of a CPU decode step at large batch sizes), a joining row is written into its slot, and
trimming moves a window. Models with other layer types (sliding windows, ...) keep their own layers:
one padded prefill, row selection without trimming, no joining (:func:`mergeable` is False).

Static mode (``new_cache(model, static=True)``, :class:`SlackLayer` ``static``): every decode step
(a one-column update) sees keys, values and mask of the window's width rounded up to a multiple of
:data:`STATIC_COLUMNS` (:meth:`SlackLayer.width`), not the window's exact width, so the decode
step's tensor shapes change only when the window crosses a multiple of it (or the batch's row count
changes) — what CUDA graphs and per-shape kernel planning need. The extra columns are the buffer's
columns after the window's end: never written, zero (buffers are zero-allocated in this mode, so a
masked column never holds a NaN, which a zero attention weight would still turn into a NaN), and
masked out (:func:`feed` pads the mask with zeros on the right; :meth:`SlackLayer.get_mask_sizes`
tells the model the same width). Positions are explicit, so those columns change no row's result.
Prefill (multi-column updates) sees the exact window, as in the default (dynamic) mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

STATIC_COLUMNS = 256
"""Static mode: a decode step's key width is the window's width rounded up to a multiple of this."""


def _slack(n: int) -> int:
    return max(32, n)


def _round_up(n: int) -> int:
    return -(-n // STATIC_COLUMNS) * STATIC_COLUMNS


class SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the window ``[:b, :, s:e]`` of larger buffers.

    ``keys``/``values`` are always that window (``[B, H, n, D]`` views), so the HF bookkeeping sees a
    plain layer; the buffers grow geometrically (amortized O(1) per token). :meth:`update` returns that
    window too, or with ``static`` (see the module docstring) for a decode step ``kb[:b, :, s:s + w]``,
    ``w`` = :meth:`width` ``(1)``; then every buffer column from ``e`` on is zero (in every row).
    """

    _kb: torch.Tensor | None = None
    _vb: torch.Tensor | None = None
    _b = _s = _e = 0

    def __init__(self, static: bool = False) -> None:
        super().__init__()
        self.static = static
        """Decode steps see a width rounded up to :data:`STATIC_COLUMNS`; buffers are zero-allocated."""

    def width(self, t: int) -> int:
        """Key columns the next update of ``t`` columns returns (and its mask must cover): the window
        after it, rounded up to a multiple of :data:`STATIC_COLUMNS` for a static decode step (``t == 1``)."""
        n = self._e - self._s + t
        return _round_up(n) if self.static and t == 1 else n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.static:
            return super().get_mask_sizes(query_length)
        return self.width(query_length), 0

    def _room(self, t: int) -> int:
        """Columns to leave after the window when (re)allocating so that ``t`` more fit, with slack:
        geometric, or in static mode up to one :data:`STATIC_COLUMNS` past the next decode width."""
        n = self._e - self._s
        if self.static:
            return _round_up(n + t) + STATIC_COLUMNS - n
        return t + _slack(n + t)

    def _new(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return like.new_zeros(shape) if self.static else like.new_empty(shape)

    def _set(self, kb: torch.Tensor, vb: torch.Tensor, b: int, s: int, e: int) -> None:
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = kb.dtype, kb.device, True
        self._kb, self._vb, self._b, self._s, self._e = kb, vb, b, s, e
        self.keys, self.values = kb[:b, :, s:e], vb[:b, :, s:e]

    def _bufs(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._kb is not None and self._vb is not None
        return self._kb, self._vb

    def _realloc(self, rows: int, left: int, right: int) -> None:
        """Copy the window into new buffers of ``rows`` rows, ``left`` columns before it and ``right`` after."""
        kb, vb = self._bufs()
        b, s, e = self._b, self._s, self._e
        shape = (max(rows, b), kb.shape[1], left + e - s + right, kb.shape[3])
        nk, nv = self._new(kb, shape), self._new(vb, shape)
        nk[:b, :, left:left + e - s] = kb[:b, :, s:e]
        nv[:b, :, left:left + e - s] = vb[:b, :, s:e]
        self._set(nk, nv, b, left, left + e - s)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``t`` columns to every row (a prefill or one decode step); returns :meth:`width`
        ``(t)`` columns from the window's start."""
        t = key_states.shape[-2]
        if self._kb is None:
            shape = (key_states.shape[0], key_states.shape[1], self._room(t), key_states.shape[3])
            self._set(self._new(key_states, shape), self._new(value_states, shape), key_states.shape[0], 0, 0)
        kb, vb = self._bufs()
        assert key_states.shape[0] == self._b, "a forward must feed every row of the batch"
        w = self.width(t)
        if self._s + w > kb.shape[2]:
            self._realloc(kb.shape[0], 0, self._room(t))
            kb, vb = self._bufs()
        kb[:self._b, :, self._e:self._e + t] = key_states
        vb[:self._b, :, self._e:self._e + t] = value_states
        self._set(kb, vb, self._b, self._s, self._e + t)
        return kb[:self._b, :, self._s:self._s + w], vb[:self._b, :, self._s:self._s + w]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices, 0)

    def select(self, indices: torch.Tensor, start: int) -> None:
        """Keep rows ``indices``, drop the window's first ``start`` columns (one copy; slack kept)."""
        kb, vb = self._bufs()
        s = self._s + start
        self._set(kb[indices, :, s:], vb[indices, :, s:], len(indices), 0, self._e - s)

    def trim(self, start: int) -> None:
        """Drop the window's first ``start`` columns (no copy)."""
        kb, vb = self._bufs()
        self._set(kb, vb, self._b, self._s + start, self._e)

    def widen(self, d: int) -> None:
        """``d`` more columns before the window, zero (left padding) in every row."""
        if self._s < d:
            kb, _ = self._bufs()
            self._realloc(kb.shape[0], d, self._room(0))
        kb, vb = self._bufs()
        kb[:self._b, :, self._s - d:self._s] = 0
        vb[:self._b, :, self._s - d:self._s] = 0
        self._set(kb, vb, self._b, self._s - d, self._e)

    def place(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows ``keys``/``values`` (``[m, H, w, D]``, ``w`` <= the window's width) right-aligned
        into rows ``slots`` (finished rows, or new rows right after the last), zeros before them."""
        kb, vb = self._bufs()
        b = max(self._b, max(slots) + 1)
        if b > kb.shape[0]:
            self._realloc(b + max(16, b // 4), 0, kb.shape[2] - self._e)
            kb, vb = self._bufs()
        idx = torch.tensor(slots, dtype=torch.long, device=kb.device)
        w, s, e = keys.shape[2], self._s, self._e
        kb[idx, :, s:e - w] = 0
        vb[idx, :, s:e - w] = 0
        kb[idx, :, e - w:e] = keys
        vb[idx, :, e - w:e] = values
        self._set(kb, vb, b, s, e)


def new_cache(model: PreTrainedModel, static: bool = False) -> DynamicCache:
    """An empty cache for ``model``: :class:`SlackLayer` everywhere (``static`` ones if asked) when
    every layer is a plain ``DynamicLayer``, else the model's own layer types (``static`` ignored)."""
    cache = DynamicCache(config=model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [SlackLayer(static) for _ in cache.layers]
    return cache


def mergeable(cache: DynamicCache) -> bool:
    """Whether rows can join and columns be trimmed: every layer a :class:`SlackLayer`."""
    return all(type(layer) is SlackLayer for layer in cache.layers)


def _slack_layers(cache: DynamicCache) -> list[SlackLayer]:
    out = []
    for layer in cache.layers:
        assert isinstance(layer, SlackLayer)
        out.append(layer)
    return out


@dataclass
class Batch:
    """Rows decoding together (see the module docstring for the state between steps)."""

    rows: list[int]
    """Batch row -> the caller's request index (a finished request's row stays until reused or dropped)."""
    cache: DynamicCache
    logits: torch.Tensor
    mask: torch.Tensor
    last_pos: torch.Tensor


def prefill(model: PreTrainedModel, seqs: list[list[int]], rows: list[int], pad_id: int,
            prefill_tokens: int, static: bool = False) -> Batch:
    """A batch of ``seqs`` (row ``b`` is request ``rows[b]``) with its KV cache filled.

    Identical sequences (a GRPO group's copies of one prompt) are computed once and their cache rows
    repeated; distinct ones are computed in length-sorted chunks of at most ``prefill_tokens`` padded
    tokens, then left-padded to a common width ``W`` (padding masked out). Same result as one
    left-padded forward over the whole batch, without its padding. ``static``: the batch's cache is
    in static mode (see the module docstring).
    """
    dev = next(model.parameters()).device
    width = max(len(s) for s in seqs)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        mask[b, width - len(s):] = 1
    mask = mask.to(dev)
    last_pos = torch.tensor([[len(s) - 1] for s in seqs], dtype=torch.long, device=dev)
    cache = new_cache(model, static)
    if not mergeable(cache):  # unknown layer types: one padded forward
        chunks_in: list[list[list[int]]] = [seqs]
        expand = list(range(len(seqs)))
    else:
        uniq: dict[tuple[int, ...], int] = {}
        row_u = [uniq.setdefault(tuple(s), len(uniq)) for s in seqs]
        keys = list(uniq)
        order = sorted(range(len(keys)), key=lambda u: len(keys[u]))
        rank = {u: r for r, u in enumerate(order)}
        expand = [rank[u] for u in row_u]
        chunks_in = []
        cur: list[list[int]] = []
        for u in order:
            if cur and (len(cur) + 1) * len(keys[u]) > prefill_tokens:
                chunks_in.append(cur)
                cur = []
            cur.append(list(keys[u]))
        chunks_in.append(cur)
    logits, parts = [], []
    for chunk in chunks_in:
        w = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), w), pad_id, dtype=torch.long)
        m = torch.zeros((len(chunk), w), dtype=torch.long)
        for b, s in enumerate(chunk):
            ids[b, w - len(s):] = torch.tensor(s, dtype=torch.long)
            m[b, w - len(s):] = 1
        ids, m = ids.to(dev), m.to(dev)
        part = new_cache(model) if len(chunks_in) > 1 else cache
        out = model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                    past_key_values=part, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1, :])
        parts.append(part)
    idx = torch.tensor(expand, dtype=torch.long, device=dev)
    if len(parts) > 1:  # chunks in length order, each right-aligned into one cache, then rows expanded
        slots = 0
        for part, chunk in zip(parts, chunks_in, strict=True):
            for layer, pl in zip(_slack_layers(cache), _slack_layers(part), strict=True):
                assert pl.keys is not None and pl.values is not None
                if slots == 0:  # the first (shortest) chunk starts the cache, widened to W
                    layer.update(pl.keys, pl.values)
                    layer.widen(width - pl.keys.shape[2])
                else:
                    layer.place(list(range(slots, slots + len(chunk))), pl.keys, pl.values)
            slots += len(chunk)
        cache.batch_select_indices(idx)
    elif expand != list(range(len(seqs))):
        cache.batch_select_indices(idx)
    return Batch(list(rows), cache, torch.cat(logits)[idx], mask, last_pos)


def absorb(batch: Batch, new: Batch, free: list[int]) -> Batch:
    """``new``'s rows join ``batch``: into the ``free`` rows (finished requests) first, then appended.

    Both are left-padded to a common width; the cost is writing the joining rows (plus a buffer
    resize now and then), not copying the running batch.
    """
    n, w = batch.mask.shape[1], new.mask.shape[1]
    if w > n:  # the newcomers are wider: every running row gets more left padding
        for layer in _slack_layers(batch.cache):
            layer.widen(w - n)
        batch.mask = torch.nn.functional.pad(batch.mask, (w - n, 0))
        n = w
    m = len(new.rows)
    reuse = free[:m]
    slots = reuse + list(range(len(batch.rows), len(batch.rows) + m - len(reuse)))
    for layer, nl in zip(_slack_layers(batch.cache), _slack_layers(new.cache), strict=True):
        assert nl.keys is not None and nl.values is not None
        layer.place(slots, nl.keys, nl.values)
    mask = torch.nn.functional.pad(new.mask, (n - w, 0))
    r = len(reuse)
    rows = list(batch.rows)
    for slot, i in zip(slots, new.rows, strict=True):
        if slot < len(rows):
            rows[slot] = i
        else:
            rows.append(i)
    tensors = []
    for old, add in ((batch.logits, new.logits), (batch.mask, mask), (batch.last_pos, new.last_pos)):
        if r:
            old = old.clone()
            old[torch.tensor(reuse, dtype=torch.long, device=old.device)] = add[:r]
        tensors.append(torch.cat([old, add[r:]]) if r < m else old)
    return Batch(rows, batch.cache, tensors[0], tensors[1], tensors[2])


def trim(batch: Batch, live: list[int]) -> None:
    """Drop the leading columns that no row of ``live`` uses (no copy of the cache)."""
    if not live or not mergeable(batch.cache):
        return
    used = batch.mask[torch.tensor(live, dtype=torch.long, device=batch.mask.device)].sum(0) > 0
    start = int(used.nonzero()[0, 0])
    if start > 0:
        for layer in _slack_layers(batch.cache):
            layer.trim(start)
        batch.mask = batch.mask[:, start:]


def select(batch: Batch, keep: list[int]) -> Batch:
    """Keep batch rows ``keep`` (in order); drop leading columns that became all padding where the
    cache allows it."""
    idx = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
    mask = batch.mask[idx]
    start = int((mask.sum(0) > 0).nonzero()[0, 0])
    if mergeable(batch.cache):
        for layer in _slack_layers(batch.cache):
            layer.select(idx, start)
        mask = mask[:, start:]
    else:
        batch.cache.batch_select_indices(idx)
    return Batch([batch.rows[b] for b in keep], batch.cache, batch.logits[idx], mask, batch.last_pos[idx])


def step_mask(batch: Batch) -> torch.Tensor:
    """The attention mask of the decode step about to run (``batch.mask`` already has its column):
    ``batch.mask`` itself, or for a static cache padded with zeros on the right to the key width
    :meth:`SlackLayer.width` ``(1)`` (the columns after the window: not written yet, masked out)."""
    layer = batch.cache.layers[0] if batch.cache.layers else None
    if not isinstance(layer, SlackLayer) or not layer.static:
        return batch.mask
    n = batch.mask.shape[1]
    assert n == layer._e - layer._s + 1, "the mask covers the cache window and the step's column"
    return torch.nn.functional.pad(batch.mask, (0, layer.width(1) - n))


def feed(model: PreTrainedModel, batch: Batch, tokens: torch.Tensor) -> None:
    """One decode step: append ``tokens`` (``[B, 1]``, one per row) and compute the next logits."""
    batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], dim=1)
    batch.last_pos = batch.last_pos + 1
    out = model(input_ids=tokens, attention_mask=step_mask(batch), position_ids=batch.last_pos,
                past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
    batch.logits = out.logits[:, -1, :]
