"""An emulated rollout engine: calibrated decode timing and long-tailed output lengths, no model.

For system benchmarks on small machines; every result produced with it must be labelled
``"emulated"`` (:attr:`EmulatedEngine.label`). It implements :class:`~.engine.Engine` exactly
(continuous batching, chunks, completion-order ``on_finish``, thread-safe ``abort``, exact resume).
The timing and length model (formulas, calibration :class:`EmulatedParams`) is
:mod:`dora_rl.core.emulation`, shared with the discrete-event simulator; this module sleeps
``time_scale`` times its model seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dora_rl.core.emulation import (
    EmulatedParams,
    decode_steps_within,
    decode_time,
    kv_admits,
    kv_steps_left,
    planned_response,
    prefill_time,
    step_time,
)

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult, checked_ids

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dora_rl.infra.weights.fetcher import FetchStats
    from dora_rl.infra.weights.sync import Fetcher
    from dora_rl.schemas.records import PolicyVersion

    from .kv_rows import KvRows

# -- the engine ------------------------------------------------------------------------------------


class _Seq:
    """One request of a running ``generate`` call: the new tokens it will emit and its progress."""

    __slots__ = ("first", "i", "kv_in", "lps", "new_ids", "new_lps", "pos", "reported", "req", "toks")

    def __init__(self, i: int, req: GenRequest, params: EmulatedParams, rows_fit: bool = False) -> None:
        self.i, self.req = i, req
        self.toks, self.lps = list(req.partial_ids), list(req.partial_logprobs)
        k = len(req.partial_ids)
        ids, lps, _ = planned_response(req.request_id, req.max_new_tokens, params)
        if k < len(ids):
            self.new_ids, self.new_lps = ids[k:], lps[k:]
        else:  # partial longer than planned (not produced here): stop at the next token
            self.new_ids, self.new_lps = [params.eos_id], [-0.1]
        self.pos = self.reported = 0
        self.first: float | None = None
        # its KV arrives once (a preemption loses it): rows that came, or the model's move (kv_moved) when none were
        # sent; rows that do not match its tokens are prefilled
        self.kv_in = params.kv_move_s_per_token > 0 and (rows_fit if req.kv is not None else req.kv_moved)

    def initial_reason(self, aborted: bool, eos_id: int) -> FinishReason | None:
        if self.toks and self.toks[-1] == eos_id:
            return "stop"
        if len(self.toks) >= self.req.max_new_tokens:
            return "length"
        return "abort" if aborted else None

    def context(self) -> int:
        """Tokens this sequence holds in the KV cache: prompt + partial + generated here."""
        return len(self.req.prompt_ids) + len(self.toks) + self.pos

    def steps_to_event(self, chunk: int) -> int:
        return min(self.reported + chunk, len(self.new_ids)) - self.pos


class EmulatedEngine:
    """Engine with emulated timing and lengths (implements :class:`~.engine.Engine`).

    ``capacity`` overrides ``params.capacity`` for this instance. Counters: ``model_time_s`` (model
    seconds spent in prefill, decode and loads), ``tokens_generated``, ``steps``, ``loads``,
    ``preemptions`` (sequences set aside when the KV cache was full, ``params.kv_capacity_tokens``, and
    recomputed — re-prefilled — when room came back).
    """

    label = "emulated"
    """Results from this engine must carry this label."""

    def __init__(self, params: EmulatedParams | None = None, capacity: int | None = None) -> None:
        self.params = params if params is not None else EmulatedParams()
        self.capacity = self.params.capacity if capacity is None else int(capacity)
        if self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.model_time_s = 0.0
        self.tokens_generated = self.steps = self.loads = self.preemptions = 0
        self._weights_lock = threading.Lock()  # held for a whole generate(): C1
        self._incoming: list[GenRequest] = []  # admitted into the running generate() (continuous batching)
        self._running = False
        self._abort_lock = threading.Lock()
        self._abort_ids: set[str] = set()
        self._export_ids: set[str] = set()
        self._abort_epoch = 0
        self.kv_imports = 0
        self.kv_fallbacks = 0
        self._wake = threading.Event()

    # -- Engine protocol -------------------------------------------------------------------------

    fetches_weights = False
    serves_weights = False
    exports_kv = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept any state dict; wait for a running ``generate`` (C1), then spend ``load_s``."""
        with self._weights_lock:
            time.sleep(self.params.load_s * self.params.time_scale)
            self.model_time_s += self.params.load_s
            self.loads += 1

    def load_version(self, announcement: PolicyVersion, fetcher: Fetcher | None) -> FetchStats | None:
        """No bytes move: only the load time of the model is spent."""
        self.load_state_dict({})
        return None

    def weights_to_serve(self) -> None:
        """An emulated instance holds no weights to serve."""
        return None

    def decode(self, token_ids: list[int]) -> str:
        """Emulated tokens have no text."""
        return ""

    def export(self, request_ids: Iterable[str]) -> bool:
        """Abort these requests at once; a decoding one's result carries stand-in KV rows (:func:`stand_in_rows`:
        its context's token ids), which an importing emulated engine checks against the resume's tokens."""
        with self._abort_lock:
            self._export_ids.update(request_ids)
        self._wake.set()
        return True

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Abort these requests (all requests of running calls if ``None``) at once.

        An id aborted before its ``generate`` starts is aborted as soon as it does.
        """
        with self._abort_lock:
            if request_ids is None:
                self._abort_epoch += 1
            else:
                self._abort_ids.update(request_ids)
        self._wake.set()

    def generate(
        self,
        requests: Sequence[GenRequest],
        on_chunk: ChunkCallback | None = None,
        chunk_tokens: int = 16,
        on_finish: FinishCallback | None = None,
    ) -> list[GenResult]:
        """Generate every request as one continuously batched run; results in request order."""
        ids = checked_ids(requests, chunk_tokens)
        with self._weights_lock:
            with self._abort_lock:
                self._running = True
            try:
                return self._run(requests, on_chunk, chunk_tokens, on_finish)
            finally:
                with self._abort_lock:
                    self._running = False
                    self._incoming.clear()  # a call that raised takes its joined requests with it
                    self._abort_ids.difference_update(ids)
                    self._export_ids.difference_update(ids)

    def add(self, requests: Sequence[GenRequest]) -> bool:
        """Thread-safe continuous batching: admit ``requests`` into the running ``generate`` call.

        Returns False (admitting nothing) when no call is running; the caller then starts one.
        Admitted requests pay their prefill at the next step boundary and report through the
        running call's callbacks; the call returns once they are finished too.
        """
        with self._abort_lock:
            if not self._running:
                return False
            self._incoming.extend(requests)
        self._wake.set()
        return True

    # -- internals -------------------------------------------------------------------------------

    def _inject_failure(self, active: Sequence[_Seq]) -> None:
        """``EmulatedParams.fail_on``: fail the first decode step that holds a poison request."""
        for s in active:
            if any(s.req.request_id.endswith(x) for x in self.params.fail_on):
                if self.params.fail_exit:
                    log.error("emulated engine: killing the process on %s (fail_on)", s.req.request_id)
                    logging.shutdown()
                    os._exit(139)
                raise RuntimeError(f"emulated engine failure on {s.req.request_id} (fail_on)")

    def _aborted(self, epoch0: int) -> tuple[set[str], bool]:
        """Ids to abort now (exported ones included) and whether every request is aborted."""
        with self._abort_lock:
            return self._abort_ids | self._export_ids, self._abort_epoch != epoch0

    def _exported(self, request_id: str) -> bool:
        with self._abort_lock:
            return request_id in self._export_ids

    def _kv_fits(self, req: GenRequest) -> bool:
        """Whether ``req`` carries rows that are its context's (counted either way); None carried: False."""
        if req.kv is None:
            return False
        fits = stand_in_tokens(req.kv) == [*req.prompt_ids, *req.partial_ids]
        self.kv_imports += fits
        self.kv_fallbacks += not fits
        if not fits:
            log.warning("%s: KV rows do not match its tokens: prefilled instead", req.request_id)
        return fits

    def _wait_until(self, deadline: float) -> bool:
        """Sleep until ``deadline`` (monotonic) unless ``abort`` wakes us; True if woken."""
        remaining = deadline - time.monotonic()
        woke = self._wake.wait(remaining) if remaining > 0 else self._wake.is_set()
        if woke:
            self._wake.clear()
        return woke

    def _run(
        self, requests: Sequence[GenRequest], on_chunk: ChunkCallback | None, chunk: int,
        on_finish: FinishCallback | None,
    ) -> list[GenResult]:
        p, scale = self.params, self.params.time_scale
        with self._abort_lock:
            epoch0 = self._abort_epoch
        results: list[GenResult | None] = [None] * len(requests)
        wall_minus_mono = time.time() - time.monotonic()

        def finish(s: _Seq, reason: FinishReason, kv: KvRows | None = None) -> None:
            with self._abort_lock:  # an id is aborted once: a later request with it (a resume) runs
                self._abort_ids.discard(s.req.request_id)
                self._export_ids.discard(s.req.request_id)
            if s.pos > s.reported and on_chunk is not None:
                on_chunk(s.req.request_id, s.new_ids[s.reported:s.pos], s.new_lps[s.reported:s.pos])
            s.reported = s.pos
            now = time.time()
            res = GenResult(s.req.request_id, s.toks + s.new_ids[:s.pos], s.lps + s.new_lps[:s.pos],
                            reason, min(s.first, now) if s.first is not None else now, now, kv)
            results[s.i] = res
            if on_finish is not None:
                on_finish(res)

        seqs = [_Seq(i, r, p, self._kv_fits(r)) for i, r in enumerate(requests)]
        ids_ab, all_ab = self._aborted(epoch0)
        active: list[_Seq] = []
        waiting: list[_Seq] = []  # admitted by the caller, waiting for KV room (or preempted: recomputed)

        def admit(t: float) -> float:
            """Start the waiting sequences that fit the KV cache, in order; prefill them (per request:
            attention is per sequence). Returns the clock after the prefill."""
            if not waiting:
                return t
            ctx, started = sum(s.context() for s in active), list[_Seq]()
            while waiting and kv_admits(ctx, len(active) + len(started), waiting[0].context(), p):
                started.append(waiting.pop(0))
                ctx += started[-1].context()
            if started:
                pre = sum(s.context() * p.kv_move_s_per_token if s.kv_in else prefill_time(s.context(), p)
                          for s in started)  # a moved KV arrives over the network, else a prefill
                for s in started:
                    s.kv_in = False
                self.model_time_s += pre
                t = max(t, time.monotonic()) + pre * scale
                self._wait_until(t)
                active.extend(started)
            return t

        for s in seqs:
            reason = s.initial_reason(s.req.request_id in ids_ab, p.eos_id)
            if reason is None:
                waiting.append(s)
            else:
                finish(s, reason)
        t = admit(time.monotonic())
        while True:
            with self._abort_lock:
                incoming, self._incoming = self._incoming, []
                if not active and not incoming and not waiting:
                    self._running = False  # from here on add() refuses: the caller starts a new call
                    break
            if incoming:
                fresh = [_Seq(len(results) + j, r, p, self._kv_fits(r)) for j, r in enumerate(incoming)]
                results.extend([None] * len(fresh))
                ids_ab, _ = self._aborted(epoch0)
                for s in fresh:
                    reason = s.initial_reason(s.req.request_id in ids_ab, p.eos_id)
                    if reason is None:
                        waiting.append(s)
                    else:
                        finish(s, reason)
            ids_ab, all_ab = self._aborted(epoch0)
            if all_ab or ids_ab:
                for group in (active, waiting):  # an exported one leaves with its rows if decoding (else it has none)
                    for s in [s for s in group if all_ab or s.req.request_id in ids_ab]:
                        group.remove(s)
                        moved = group is active and self._exported(s.req.request_id)
                        finish(s, "abort", stand_in_rows([*s.req.prompt_ids, *s.toks, *s.new_ids[:s.pos]])
                               if moved else None)
                if not active and not waiting:
                    continue  # the top of the loop ends the call, under the lock: a request add() took since
                    # the swap above is admitted there (leaving here dropped it while the caller held it running)
            t = admit(t)
            if not active:
                continue
            ctx = sum(s.context() for s in active)
            while len(active) > 1 and kv_steps_left(ctx, len(active), p) == 0:
                waiting.insert(0, active.pop())  # KV full: the newest is preempted, recomputed when it fits
                ctx -= waiting[0].context()
                self.preemptions += 1
            n = len(active)
            k = min(s.steps_to_event(chunk) for s in active)
            room = kv_steps_left(ctx, n, p)
            k = k if room is None else max(1, min(k, room))
            span = decode_time(k, n, self.capacity, ctx, p)  # model seconds of the k steps (context grows)
            if self._wait_until(t + span * scale) and span > 0 and scale > 0:
                k = min(k, decode_steps_within((time.monotonic() - t) / scale, n, self.capacity, ctx, p))
                if k == 0:
                    continue
                span = decode_time(k, n, self.capacity, ctx, p)
            first_wall = t + step_time(n, self.capacity, p, ctx) * scale + wall_minus_mono
            t += span * scale
            self.model_time_s += span
            self.steps += k
            self.tokens_generated += k * len(active)
            self._inject_failure(active)
            still: list[_Seq] = []
            for s in active:
                if s.first is None:
                    s.first = first_wall
                s.pos += k
                if s.pos == len(s.new_ids):
                    finish(s, "stop" if s.new_ids[-1] == p.eos_id else "length")
                    continue
                if s.pos - s.reported >= chunk:
                    if on_chunk is not None:
                        on_chunk(s.req.request_id, s.new_ids[s.reported:s.pos], s.new_lps[s.reported:s.pos])
                    s.reported = s.pos
                still.append(s)
            active = still
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]


def stand_in_rows(tokens: list[int]) -> KvRows:
    """The emulated engine's KV rows of a context: its token ids (float32, ``[1, n, 1]``, one layer), so an
    import can check it got this trajectory's rows over a real transfer (torch and the rows module are imported
    when the instance's KV outbox is built, ``kv_moves.load_rows_module``; never by an instance that moves nothing)."""
    import torch

    from .kv_rows import KvRows

    ids = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    return KvRows((ids,), (ids.clone(),), torch.zeros(1))


def stand_in_tokens(rows: KvRows) -> list[int]:
    """The token ids :func:`stand_in_rows` wrote (``[]`` for rows of another shape)."""
    if len(rows.keys) != 1 or rows.keys[0].dim() != 3 or rows.keys[0].shape[0] != 1 or rows.keys[0].shape[2] != 1:
        return []
    return [int(x) for x in rows.keys[0].flatten().tolist()]
