"""A plain-torch rollout engine: batched KV-cache decoding with any HF causal LM (CPU or GPU).

Layout of one ``generate`` call: every request's ``prompt_ids + partial_ids`` is a row of a
left-padded ``[B, L]`` batch with ``attention_mask`` 1 on real tokens and explicit
``position_ids = clamp(cumsum(attention_mask) - 1, min=0)`` (so a row's positions do not depend on
its padding). Prefill fills a ``DynamicCache`` (identical rows — a GRPO group — computed once,
distinct rows in length-sorted chunks to avoid padding); then each step feeds the token just
sampled at ``position = last position + 1``.

Sampling: ``logp = log_softmax(logits.float() / temperature)``, ``token ~ Categorical(exp(logp))``,
and the returned log-prob is ``logp[token]`` — exactly what
:func:`dora_rl.consumers.trainer.grpo.sequence_logprobs` recomputes with the same weights and
temperature (checked to 1e-4 in the tests). Re-prefilling ``prompt + partial`` reproduces the same
conditional distribution as the uninterrupted run, which is what makes migration exact.

Finished rows are compacted out of the batch (KV cache rows selected, all-padding leading columns
trimmed) once at least an eighth of the rows are finished, so stragglers decode in a small batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from dora_rl.modeling import decode_completion, load_weights, state_dict_for_transfer

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult, checked_ids

if TYPE_CHECKING:
    from dora_rl.infra.weight_sync import Fetcher
    from dora_rl.infra.weights.fetcher import FetchStats
    from dora_rl.schemas.records import PolicyVersion


class TorchEngine:
    """Batched sampler over a HF causal LM (implements :class:`~.engine.Engine`).

    ``temperature`` must be > 0 (log-probs of the sampling distribution must exist). ``eos_id``
    defaults to the tokenizer's EOS; a sequence of ids means "stop at any of them". ``seed`` seeds
    this engine's private ``torch.Generator`` (the global RNG is never used). ``prefill_tokens``
    bounds the padded size of one prefill forward.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        temperature: float = 1.0,
        eos_id: int | Sequence[int] | None = None,
        seed: int = 0,
        pad_id: int | None = None,
        prefill_tokens: int = 4096,
    ) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        if eos_id is None:
            if tokenizer is None or tokenizer.eos_token_id is None:
                raise ValueError("need eos_id or a tokenizer with an EOS token")
            eos_id = int(tokenizer.eos_token_id)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.temperature = float(temperature)
        self.eos_ids: frozenset[int] = frozenset([eos_id] if isinstance(eos_id, int) else eos_id)
        if pad_id is None:
            pad_id = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_id = int(pad_id) if pad_id is not None else min(self.eos_ids)
        self.prefill_tokens = int(prefill_tokens)
        self.device = next(model.parameters()).device
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._weights_lock = threading.Lock()  # held for a whole generate(): C1
        self._abort_lock = threading.Lock()
        self._abort_ids: set[str] = set()
        self._abort_epoch = 0  # bumped by abort(None): aborts every call that started before

    # -- Engine protocol -------------------------------------------------------------------------

    fetches_weights = True
    serves_weights = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the weights in place; waits for a running ``generate`` to finish (C1)."""
        with self._weights_lock:
            load_weights(self.model, state_dict)

    def load_version(self, announcement: PolicyVersion, fetcher: Fetcher | None) -> FetchStats | None:
        """Fetch the announced version straight into the model's parameters (C1: under the weights lock)."""
        if fetcher is None:
            raise ValueError("the torch engine loads versions through a weight fetcher")
        with self._weights_lock:
            return fetcher.fetch_into(announcement, self.model)

    def weights_to_serve(self) -> dict[str, Any]:
        """A snapshot of the loaded weights (tied tensors once), for serving to peers."""
        with self._weights_lock:
            return state_dict_for_transfer(self.model)

    def add(self, requests: Sequence[GenRequest]) -> bool:
        """Static batching: requests wait for the next ``generate`` call."""
        return False

    def decode(self, token_ids: list[int]) -> str:
        return decode_completion(self.tokenizer, token_ids) if self.tokenizer is not None else ""

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Abort these requests (every request of running calls if ``None``) at the next step.

        An id aborted before its ``generate`` starts is aborted at once when it does.
        """
        with self._abort_lock:
            if request_ids is None:
                self._abort_epoch += 1
            else:
                self._abort_ids.update(request_ids)

    def generate(
        self,
        requests: Sequence[GenRequest],
        on_chunk: ChunkCallback | None = None,
        chunk_tokens: int = 16,
        on_finish: FinishCallback | None = None,
    ) -> list[GenResult]:
        """Generate every request (see :class:`~.engine.Engine`); results in request order."""
        ids = checked_ids(requests, chunk_tokens)
        with self._weights_lock, torch.no_grad():
            try:
                return _Run(self, requests, on_chunk, chunk_tokens, on_finish).run()
            finally:
                with self._abort_lock:
                    self._abort_ids.difference_update(ids)

    # -- internals -------------------------------------------------------------------------------

    def _abort_state(self) -> tuple[set[str], int]:
        with self._abort_lock:
            return (set(self._abort_ids) if self._abort_ids else set()), self._abort_epoch


class _Run:
    """State of one ``generate`` call (per-request buffers, the batch, the KV cache)."""

    def __init__(
        self, eng: TorchEngine, requests: Sequence[GenRequest], on_chunk: ChunkCallback | None,
        chunk_tokens: int, on_finish: FinishCallback | None,
    ) -> None:
        self.eng, self.requests = eng, requests
        self.on_chunk, self.chunk_tokens, self.on_finish = on_chunk, chunk_tokens, on_finish
        n = len(requests)
        self.tokens = [list(r.partial_ids) for r in requests]
        self.logprobs = [list(r.partial_logprobs) for r in requests]
        self.buf_t: list[list[int]] = [[] for _ in range(n)]
        self.buf_l: list[list[float]] = [[] for _ in range(n)]
        self.first: list[float | None] = [None] * n
        self.results: list[GenResult | None] = [None] * n
        _, self.epoch0 = eng._abort_state()

    def _finish(self, i: int, reason: FinishReason) -> None:
        now = time.time()
        rid = self.requests[i].request_id
        if self.buf_t[i] and self.on_chunk is not None:
            self.on_chunk(rid, self.buf_t[i], self.buf_l[i])
        self.buf_t[i], self.buf_l[i] = [], []
        first = self.first[i]
        res = GenResult(rid, self.tokens[i], self.logprobs[i], reason,
                        first if first is not None else now, now)
        self.results[i] = res
        if self.on_finish is not None:
            self.on_finish(res)

    def _done_reason(self, i: int, aborted: set[str], epoch: int) -> FinishReason | None:
        toks, req = self.tokens[i], self.requests[i]
        if toks and toks[-1] in self.eng.eos_ids:
            return "stop"
        if len(toks) >= req.max_new_tokens:
            return "length"
        if epoch != self.epoch0 or req.request_id in aborted:
            return "abort"
        return None

    def run(self) -> list[GenResult]:
        eng = self.eng
        aborted, epoch = eng._abort_state()
        rows: list[int] = []  # batch row -> request index
        for i in range(len(self.requests)):
            reason = self._done_reason(i, aborted, epoch)
            if reason is None:
                rows.append(i)
            else:
                self._finish(i, reason)
        if rows:
            self._decode(rows)
        assert all(r is not None for r in self.results)
        return [r for r in self.results if r is not None]

    def _prefill(self, seqs: list[list[int]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill a KV cache for ``seqs``; returns ``(cache, last_logits [B, V], mask [B, W], last_pos [B, 1])``.

        Identical sequences (a GRPO group's copies of one prompt) are computed once and their cache
        rows repeated; distinct ones are computed in length-sorted chunks of at most
        ``prefill_tokens`` padded tokens, then left-padded to a common width ``W`` (padding masked
        out). Same result as one left-padded forward over the whole batch, without its padding.
        """
        eng, dev = self.eng, self.eng.device
        width = max(len(s) for s in seqs)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            mask[b, width - len(s):] = 1
        mask = mask.to(dev)
        last_pos = torch.tensor([[len(s) - 1] for s in seqs], dtype=torch.long, device=dev)
        cache = DynamicCache(config=eng.model.config)
        if not _trimmable(cache):  # unknown layer types: one padded forward
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
                if cur and (len(cur) + 1) * len(keys[u]) > eng.prefill_tokens:
                    chunks_in.append(cur)
                    cur = []
                cur.append(list(keys[u]))
            chunks_in.append(cur)
        logits, parts = [], []
        for chunk in chunks_in:
            w = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), w), eng.pad_id, dtype=torch.long)
            m = torch.zeros((len(chunk), w), dtype=torch.long)
            for b, s in enumerate(chunk):
                ids[b, w - len(s):] = torch.tensor(s, dtype=torch.long)
                m[b, w - len(s):] = 1
            ids, m = ids.to(dev), m.to(dev)
            part = DynamicCache(config=eng.model.config) if len(chunks_in) > 1 else cache
            out = eng.model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                            past_key_values=part, use_cache=True, logits_to_keep=1)
            logits.append(out.logits[:, -1, :])
            parts.append(part)
        idx = torch.tensor(expand, dtype=torch.long, device=dev)
        if len(parts) > 1:
            for li, layer in enumerate(cache.layers):
                ks, vs = [], []
                for part in parts:
                    pl = part.layers[li]
                    assert isinstance(pl, DynamicLayer) and pl.keys is not None and pl.values is not None
                    pad = (0, 0, width - pl.keys.shape[-2], 0)
                    ks.append(torch.nn.functional.pad(pl.keys, pad))
                    vs.append(torch.nn.functional.pad(pl.values, pad))
                assert isinstance(layer, DynamicLayer)
                layer.update(torch.cat(ks)[idx], torch.cat(vs)[idx])
        elif expand != list(range(len(seqs))):
            cache.batch_select_indices(idx)
        return cache, torch.cat(logits)[idx], mask, last_pos

    def _decode(self, rows: list[int]) -> None:
        eng, dev = self.eng, self.eng.device
        cache, last_logits, mask, last_pos = self._prefill(
            [self.requests[i].prompt_ids + self.requests[i].partial_ids for i in rows])
        alive = list(rows)
        while True:
            logp = torch.log_softmax(last_logits.float() / eng.temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=eng._gen)  # [B, 1]
            nlp = logp.gather(-1, nxt)[:, 0]
            now = time.time()
            aborted, epoch = eng._abort_state()
            keep: list[int] = []
            for b, (tok, lp) in enumerate(zip(nxt[:, 0].tolist(), nlp.tolist(), strict=True)):
                i = rows[b]
                if self.results[i] is not None:  # finished earlier, row not compacted yet
                    continue
                self.tokens[i].append(tok)
                self.logprobs[i].append(lp)
                if self.first[i] is None:
                    self.first[i] = now
                self.buf_t[i].append(tok)
                self.buf_l[i].append(lp)
                if len(self.buf_t[i]) >= self.chunk_tokens and self.on_chunk is not None:
                    self.on_chunk(self.requests[i].request_id, self.buf_t[i], self.buf_l[i])
                    self.buf_t[i], self.buf_l[i] = [], []
                reason = self._done_reason(i, aborted, epoch)
                if reason is None:
                    keep.append(b)
                else:
                    self._finish(i, reason)
            alive = [rows[b] for b in keep]
            if not alive:
                return
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            last_pos = last_pos + 1
            if (len(rows) - len(keep)) * 8 >= len(rows):
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                mask, last_pos, nxt = mask[idx], last_pos[idx], nxt[idx]
                start = int((mask.sum(0) > 0).nonzero()[0, 0])
                _compact_cache(cache, idx, start)
                if start > 0 and _trimmable(cache):
                    mask = mask[:, start:]
                rows = alive
            out = eng.model(input_ids=nxt, attention_mask=mask, position_ids=last_pos,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
            last_logits = out.logits[:, -1, :]


def _trimmable(cache: DynamicCache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _compact_cache(cache: DynamicCache, idx: torch.Tensor, start: int) -> None:
    """Keep batch rows ``idx``; drop the first ``start`` (all-padding) columns if every layer allows."""
    if start > 0 and _trimmable(cache):
        for layer in cache.layers:
            assert isinstance(layer, DynamicLayer)
            keys, values = layer.keys, layer.values
            assert keys is not None and values is not None
            layer.keys = keys[idx, :, start:]
            layer.values = values[idx, :, start:]
    else:
        cache.batch_select_indices(idx)
