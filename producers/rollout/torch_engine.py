"""A plain-torch rollout engine: continuously batched KV-cache decoding with any HF causal LM (CPU or GPU).

Layout of one ``generate`` call (the batch itself: :mod:`.torch_batch`): every request's
``prompt_ids + partial_ids`` is a row of a left-padded ``[B, L]`` batch with ``attention_mask`` 1 on
real tokens and explicit ``position_ids = clamp(cumsum(attention_mask) - 1, min=0)`` (so a row's
positions do not depend on its padding). Prefill fills a ``DynamicCache`` (identical rows — a GRPO
group — computed once, distinct rows in length-sorted chunks to avoid padding); then each step feeds
the token just sampled at ``position = last position + 1``.

Continuous batching: :meth:`TorchEngine.add` hands requests to the running call; at the next step
boundary the decode loop prefills them (as above) and writes their cache rows into the rows of
finished requests (else appends them), left-padded to the batch's width, so they start decoding at
once instead of waiting for the call's slowest row. C1 holds: the weights lock is held for the whole
call, so every row of it — joined ones included — is sampled from the weights loaded when it began
(the caller adds only requests of the version it holds). The call returns when no row is left and
nothing was added.

Sampling: ``logp = log_softmax(logits.float() / temperature)``, ``token ~ Categorical(exp(logp))``
drawn from the request's own stream (:mod:`.sampling`: keyed by the engine's ``seed``, the request id
and the token's index in the response, so it does not depend on the batch or the instance), and the
returned log-prob is ``logp[token]`` — exactly what
:func:`dora_rl.consumers.trainer.grpo.sequence_logprobs` recomputes with the same weights and
temperature (checked to 1e-4 in the tests, joined rows included). Re-prefilling ``prompt + partial``
reproduces the same conditional distribution as the uninterrupted run, which is what makes migration
exact.

Moving with the KV cache (:mod:`.kv_rows`): :meth:`TorchEngine.export` takes running requests out of
the batch at the next step boundary; each finishes with ``"abort"`` and its result carries its KV rows
and next-token logits. A request that carries such rows (``GenRequest.kv``) joins a running batch of an
engine holding the same version without a prefill, and, with the same ``seed``, continues with the same
tokens as if it had not moved. Rows that do not fit this model are prefilled instead
(``kv_fallbacks`` counts why).

Finished rows stay in the batch for joining requests to take; once at least an eighth of the rows
are finished for more than ``COMPACT_PATIENCE`` steps (or half at once) they are dropped (KV cache
rows selected, all-padding leading columns trimmed), so stragglers decode in a small batch. The KV
cache appends in place (:class:`.torch_batch.SlackLayer`) instead of copying itself every step.

``static_cache=True`` makes the decode step's key width (keys, values, attention mask) the cache
window's width rounded up to a multiple of :data:`.torch_batch.STATIC_COLUMNS`, the columns past the
window zero and masked out, so it changes only every that many tokens (or when trimming crosses a
multiple): fixed shapes for CUDA graphs and per-shape kernel planning (cuDNN attention plans each new
key length). Same tokens and log-probs as the default mode, at the cost of attending over up to
``STATIC_COLUMNS - 1`` masked columns per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dora_rl.modeling import attention_kernels, decode_completion, load_weights, state_dict_for_transfer

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult, checked_ids
from .kv_rows import KvRows, export_row, import_rows, unfit
from .sampling import sample
from .torch_batch import Batch, absorb, feed, mergeable, new_cache, prefill, select, trim

if TYPE_CHECKING:
    from dora_rl.infra.weights.fetcher import FetchStats
    from dora_rl.infra.weights.sync import Fetcher
    from dora_rl.schemas.records import PolicyVersion

log = logging.getLogger(__name__)

COMPACT_PATIENCE = 4
"""Decode steps a batch keeps finished rows (an eighth or more, under half) for joining requests to
take before it drops them (a copy of the whole cache)."""


class TorchEngine:
    """Continuously batched sampler over a HF causal LM (implements :class:`~.engine.Engine`).

    ``temperature`` must be > 0 (log-probs of the sampling distribution must exist). ``eos_id``
    defaults to the tokenizer's EOS; a sequence of ids means "stop at any of them". ``seed`` seeds
    the per-request sampling streams (:mod:`.sampling`; the global RNG is never used): the instances of
    a run share it, so a request continues identically wherever it moves. ``prefill_tokens``
    bounds the padded size of one prefill forward. Models whose KV cache layers cannot be merged
    (see :func:`.torch_batch.mergeable`) are batched statically (``add`` returns False).
    ``static_cache``: decode steps see a key width that changes rarely (see the module docstring;
    no effect for those models).
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
        static_cache: bool = False,
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
        self.static_cache = bool(static_cache)
        """Decode steps attend over the cache window rounded up to ``STATIC_COLUMNS`` columns
        (:mod:`.torch_batch` static mode): fixed shapes between roundings; same results."""
        self.device = next(model.parameters()).device
        self.continuous = mergeable(new_cache(model))
        """Whether requests can join a running call (:meth:`add`)."""
        self.seed = int(seed)
        self.kv_imports = 0
        """Requests that joined from their KV rows (no prefill)."""
        self.kv_fallbacks: Counter[str] = Counter()
        """Requests that carried KV rows and were prefilled instead, by reason (:func:`.kv_rows.unfit`)."""
        self._weights_lock = threading.Lock()  # held for a whole generate(): C1
        self._abort_lock = threading.Lock()  # also guards _incoming and _running
        self._abort_ids: set[str] = set()
        self._export_ids: set[str] = set()
        self._abort_epoch = 0  # bumped by abort(None): aborts every call that started before
        self._incoming: list[GenRequest] = []  # added to the running call, not yet admitted
        self._running = False  # a call runs and still admits requests

    # -- Engine protocol -------------------------------------------------------------------------

    fetches_weights = True
    serves_weights = True
    exports_kv = True

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
        """Thread-safe continuous batching: admit ``requests`` into the running ``generate`` call.

        Returns False (admitting nothing) when no call runs (or is about to return) or the model's
        cache cannot merge rows; the caller then starts a new call. Admitted requests are prefilled
        and join the batch at the next decode step, report through the running call's callbacks, and
        the call returns once they are finished too. Their ids must differ from the call's unfinished
        ones.
        """
        if not self.continuous:
            return False
        with self._abort_lock:
            if not self._running:
                return False
            self._incoming.extend(requests)
        return True

    def decode(self, token_ids: list[int]) -> str:
        return decode_completion(self.tokenizer, token_ids) if self.tokenizer is not None else ""

    def export(self, request_ids: Iterable[str]) -> bool:
        """Thread-safe: at the next step boundary these requests leave the running batch, each finishing
        with ``"abort"`` and its KV rows in ``GenResult.kv`` (one not admitted yet leaves once it is;
        one that finishes first finishes as usual). False (nothing asked) when rows cannot be moved."""
        if not self.continuous:
            return False
        with self._abort_lock:
            self._export_ids.update(request_ids)
        return True

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Abort these requests (every request of running calls if ``None``) at the next step.

        An id aborted before its ``generate`` starts (or before it joins a running call) is aborted at
        once when it does.
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
        """Generate every request (see :class:`~.engine.Engine`); results in request order, then the
        requests :meth:`add` admitted, in admission order."""
        checked_ids(requests, chunk_tokens)
        with self._weights_lock, torch.no_grad(), attention_kernels(self.device):
            run = _Run(self, requests, on_chunk, chunk_tokens, on_finish)
            with self._abort_lock:
                self._running = True
            try:
                return run.run()
            finally:
                with self._abort_lock:
                    self._running = False
                    self._incoming.clear()  # a call that raised takes the requests that joined it along
                    self._abort_ids.difference_update(r.request_id for r in run.requests)
                    self._export_ids.difference_update(r.request_id for r in run.requests)

    # -- internals -------------------------------------------------------------------------------

    def _abort_state(self) -> tuple[set[str], int]:
        with self._abort_lock:
            return (set(self._abort_ids) if self._abort_ids else set()), self._abort_epoch

    def _take_incoming(self, idle: bool) -> list[GenRequest] | None:
        """Requests added since the last step; None (and no more admissions) when ``idle`` and none."""
        with self._abort_lock:
            incoming, self._incoming = self._incoming, []
            if idle and not incoming:
                self._running = False  # from here on add() refuses: the caller starts a new call
                return None
            return incoming

    def _exports(self) -> set[str]:
        with self._abort_lock:
            return set(self._export_ids)

    def _forget_abort(self, request_id: str) -> None:
        with self._abort_lock:  # an id is aborted (exported) once: a later request with it (a resume) runs
            self._abort_ids.discard(request_id)
            self._export_ids.discard(request_id)


class _Run:
    """State of one ``generate`` call (per-request buffers and the running batch); request index ``i``
    is the call's ``i``-th request, those admitted by ``add`` numbered after the initial ones."""

    def __init__(
        self, eng: TorchEngine, requests: Sequence[GenRequest], on_chunk: ChunkCallback | None,
        chunk_tokens: int, on_finish: FinishCallback | None,
    ) -> None:
        self.eng = eng
        self.on_chunk, self.chunk_tokens, self.on_finish = on_chunk, chunk_tokens, on_finish
        self.requests: list[GenRequest] = []
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.buf_t: list[list[int]] = []
        self.buf_l: list[list[float]] = []
        self.first: list[float | None] = []
        self.results: list[GenResult | None] = []
        self.unfinished: set[str] = set()
        self.crowded = 0  # consecutive steps with at least an eighth of the rows finished
        _, self.epoch0 = eng._abort_state()
        self._register(requests)

    def _register(self, requests: Sequence[GenRequest]) -> list[int]:
        """Append ``requests`` to the call; returns their indices."""
        start = len(self.requests)
        for r in requests:
            if r.request_id in self.unfinished:
                raise ValueError(f"{r.request_id}: already running in this generate() call")
            self.unfinished.add(r.request_id)
            self.requests.append(r)
            self.tokens.append(list(r.partial_ids))
            self.logprobs.append(list(r.partial_logprobs))
            self.buf_t.append([])
            self.buf_l.append([])
            self.first.append(None)
            self.results.append(None)
        return list(range(start, len(self.requests)))

    def _finish(self, i: int, reason: FinishReason, kv: KvRows | None = None) -> None:
        now = time.time()
        rid = self.requests[i].request_id
        if self.buf_t[i] and self.on_chunk is not None:
            self.on_chunk(rid, self.buf_t[i], self.buf_l[i])
        self.buf_t[i], self.buf_l[i] = [], []
        first = self.first[i]
        res = GenResult(rid, self.tokens[i], self.logprobs[i], reason,
                        first if first is not None else now, now, kv)
        self.results[i] = res
        self.unfinished.discard(rid)
        self.eng._forget_abort(rid)
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

    def _admit(self, batch: Batch | None, fresh: list[int]) -> Batch | None:
        """Finish the ``fresh`` requests that are already done (or aborted); prefill the others (or
        import their KV rows) and put them into ``batch``: in the rows of finished requests first, then
        appended."""
        aborted, epoch = self.eng._abort_state()
        rows: list[int] = []
        for i in fresh:
            reason = self._done_reason(i, aborted, epoch)
            if reason is None:
                rows.append(i)
            else:
                self._finish(i, reason)
        moved = {i for i in rows if self._kv_fits(i)}
        for new in self._joining([i for i in rows if i in moved], [i for i in rows if i not in moved]):
            batch = new if batch is None else absorb(
                batch, new, [b for b, i in enumerate(batch.rows) if self.results[i] is not None])
        return batch

    def _kv_fits(self, i: int) -> bool:
        """Whether request ``i`` carries KV rows this engine can continue from (else it is prefilled,
        the reason counted)."""
        req, eng = self.requests[i], self.eng
        if req.kv is None:
            return False
        why = unfit(eng.model, req.kv, len(req.prompt_ids) + len(req.partial_ids))
        if why is not None:
            eng.kv_fallbacks[why] += 1
            log.warning("%s: KV rows do not fit this model (%s): prefilled instead", req.request_id, why)
            return False
        eng.kv_imports += 1
        return True

    def _joining(self, moved: list[int], cold: list[int]) -> list[Batch]:
        """The batches that join: ``cold`` requests prefilled, ``moved`` ones from their KV rows."""
        eng, out = self.eng, []
        if cold:
            out.append(prefill(eng.model, [self.requests[i].prompt_ids + self.requests[i].partial_ids
                                            for i in cold], cold, eng.pad_id, eng.prefill_tokens, eng.static_cache))
        if moved:
            kvs = [self.requests[i].kv for i in moved]
            out.append(import_rows(eng.model, [kv for kv in kvs if kv is not None], moved, eng.static_cache))
        return out

    def run(self) -> list[GenResult]:
        batch: Batch | None = None
        fresh: list[GenRequest] | None = list(self.requests)
        indices = list(range(len(self.requests)))
        while fresh is not None:
            if indices:
                batch = self._admit(batch, indices)
            if batch is not None:
                batch = self._step(batch)
            if batch is not None:
                self._export(batch)
            fresh = self.eng._take_incoming(idle=batch is None)
            indices = self._register(fresh) if fresh else []
        assert all(r is not None for r in self.results)
        return [r for r in self.results if r is not None]

    def _export(self, batch: Batch) -> None:
        """Finish the running requests asked for by :meth:`TorchEngine.export`, with their KV rows."""
        wanted = self.eng._exports()
        if not wanted:
            return
        for b, i in enumerate(batch.rows):
            if self.results[i] is None and self.requests[i].request_id in wanted:
                self._finish(i, "abort", export_row(batch, b))

    def _step(self, batch: Batch) -> Batch | None:
        """Sample one token for every row and feed it; None when no row is left."""
        eng = self.eng
        logp = torch.log_softmax(batch.logits.float() / eng.temperature, dim=-1)
        nxt = sample(logp, eng.seed, [self.requests[i].request_id for i in batch.rows],
                     [len(self.tokens[i]) for i in batch.rows])  # [B, 1]
        nlp = logp.gather(-1, nxt)[:, 0]
        now = time.time()
        aborted, epoch = eng._abort_state()
        keep: list[int] = []
        finished = False
        for b, (tok, lp) in enumerate(zip(nxt[:, 0].tolist(), nlp.tolist(), strict=True)):
            i = batch.rows[b]
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
                finished = True
        if not keep:
            return None
        dead = len(batch.rows) - len(keep)
        crowd = dead * 8 >= len(batch.rows)
        self.crowded = self.crowded + 1 if crowd else 0
        if crowd and (self.crowded > COMPACT_PATIENCE or dead * 2 >= len(batch.rows) or not eng.continuous):
            batch = select(batch, keep)  # a copy of the cache: only when joiners did not take the rows
            nxt = nxt[torch.tensor(keep, dtype=torch.long, device=nxt.device)]
            self.crowded = 0
        elif finished:
            trim(batch, keep)
        feed(eng.model, batch, nxt)
        return batch
