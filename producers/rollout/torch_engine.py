"""A plain-torch rollout engine: batched KV-cache decoding with any HF causal LM (CPU or GPU).

Layout of one ``generate`` call: every request's ``prompt_ids + partial_ids`` is left-padded into a
``[B, L]`` batch with ``attention_mask`` 1 on real tokens and explicit
``position_ids = clamp(cumsum(attention_mask) - 1, min=0)`` (so a row's positions do not depend on
its padding). One prefill pass fills a ``DynamicCache``; then each step feeds the token just sampled
at ``position = last position + 1``.

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
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from dora_rl.modeling import load_weights

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult


class TorchEngine:
    """Batched sampler over a HF causal LM (implements :class:`~.engine.Engine`).

    ``temperature`` must be > 0 (log-probs of the sampling distribution must exist). ``eos_id``
    defaults to the tokenizer's EOS; a sequence of ids means "stop at any of them". ``seed`` seeds
    this engine's private ``torch.Generator`` (the global RNG is never used).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        temperature: float = 1.0,
        eos_id: int | Sequence[int] | None = None,
        seed: int = 0,
        pad_id: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        if eos_id is None:
            if tokenizer is None or tokenizer.eos_token_id is None:
                raise ValueError("need eos_id or a tokenizer with an EOS token")
            eos_id = int(tokenizer.eos_token_id)
        self.model = model.eval()
        self.temperature = float(temperature)
        self.eos_ids: frozenset[int] = frozenset([eos_id] if isinstance(eos_id, int) else eos_id)
        if pad_id is None:
            pad_id = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_id = int(pad_id) if pad_id is not None else min(self.eos_ids)
        self.device = next(model.parameters()).device
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._weights_lock = threading.Lock()  # held for a whole generate(): C1
        self._abort_lock = threading.Lock()
        self._abort_ids: set[str] = set()
        self._abort_epoch = 0  # bumped by abort(None): aborts every call that started before

    # -- Engine protocol -------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the weights in place; waits for a running ``generate`` to finish (C1)."""
        with self._weights_lock:
            load_weights(self.model, state_dict)

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
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request ids in one generate() call")
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

    def _decode(self, rows: list[int]) -> None:
        eng, dev = self.eng, self.eng.device
        seqs = [self.requests[i].prompt_ids + self.requests[i].partial_ids for i in rows]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(rows), width), eng.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            input_ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[b, width - len(s):] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=eng.model.config)
        out = eng.model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
        last_pos = pos[:, -1:]
        alive = list(rows)
        while True:
            logp = torch.log_softmax(out.logits[:, -1, :].float() / eng.temperature, dim=-1)
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
