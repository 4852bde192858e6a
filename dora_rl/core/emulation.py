"""The emulated rollout model: calibrated decode timing and long-tailed output lengths, as pure functions.

One home for the model that the emulated engine (:mod:`dora_rl.producers.rollout.emulated`, which
sleeps ``time_scale`` times these model seconds) and the discrete-event simulator
(:mod:`dora_rl.streams.simulator`, which adds them to its virtual clock) both call.

**Timing model** (model seconds):

* decode step with ``n`` active sequences holding ``ctx`` tokens of context in all (prompt + tokens
  so far) on an instance of capacity ``C`` (memory-bound decode: the weights are read once per step,
  ~constant up to ``C``, then linear; plus every active sequence's KV cache is read)::

      step_time(n, C, ctx) = base_step_s * (1 + alpha * min(n, C) / C) * max(1, n / C)
                             + kv_s_per_token * ctx                                   (0 if n == 0)

  ``k`` steps in a row with the same ``n`` sequences (the context grows by ``n`` per step) take
  ``k * a(n) + kv_s_per_token * (k * ctx0 + n * k * (k - 1) / 2)`` (:func:`decode_time`), inverted in
  closed form by :func:`decode_steps_within`;
* prefill when requests are admitted: ``prefill_s_per_token * T + prefill_s_per_token_sq * T**2 / 2``
  with ``T = sum(len(prompt) + len(partial))`` (linear layers plus causal attention), so resuming a
  long partial costs more than its length alone;
* **KV capacity** (``kv_capacity_tokens`` per instance, 0 = unbounded): a request is admitted only while
  the instance's context plus its own fits; when the next step would overflow, the most recently
  admitted sequence is preempted and recomputed later (re-prefill of prompt + partial), as vLLM does
  (:func:`kv_admits`, :func:`kv_steps_left`);
* **instance imbalance** (``instance_speed_sigma``, 0 = identical instances): instance ``i`` runs every
  decode and prefill cost above ``f_i`` times as slowly, ``f_i = exp(sigma * z_i + sigma**2 / 2)`` with
  ``z_i ~ N(0, 1)`` hashed from ``(seed, i)``: its speed ``1 / f_i`` is log-normal with mean 1, so a
  large fleet computes as much as identical instances would (the bubble-free bound is unchanged) and
  what a schedule loses to the spread is its own; :func:`for_instance` gives instance ``i`` its scaled
  parameters, for the emulated engine (:func:`dora_rl.producers.rollout.requests.make_engine`) and the
  simulator alike.

**Length model** (all draws are hashes of ``(seed, key)``, so a length is a pure function of
``(seed, request_id, max_new_tokens)``; request ids are ``"<group_id>/<sample_index>"``, and the key is
:func:`workload_key`: the id without a run's ``"<run_id>/"`` prefix, so a run's ``i``-th prompt draws the same
lengths in every run with its seed and two modes compared on one seed see one workload)::

    m = length_median or median_fraction * max_new_tokens
    z = sqrt(rho) * g_group + sqrt(1 - rho) * e_request          g, e ~ N(0, 1), rho = group_correlation
    body = max(1, round(m * exp(sigma * z)))                      log-normal, p99/p50 = exp(2.326 sigma)
    runaway iff sqrt(rho) * h_group + sqrt(1 - rho) * f_request > Phi^-1(1 - p_force)
    p_force = max(0, cap_fraction - P(body >= cap)) / (1 - P(body >= cap))
    length = cap if runaway or body >= cap else body              cap = max_new_tokens

so ``P(length == cap) ~= cap_fraction`` (when the body's own tail is below it) and both the body and
the runaway event are correlated within a group. A response of ``length < cap`` ends with EOS
(``"stop"``); one of ``cap`` tokens ends with ``"length"``. Tokens are pseudo-random ids in
``[3, vocab)`` (never ``eos_id``) with log-probs ``-min(1e-3 + Exp(mean 0.35), 2.999)`` in ``[-3, 0)``, a
pure function of ``(seed, request_id, max_new_tokens)`` too: a request resumed from ``partial_ids``
continues at position ``len(partial_ids)`` and ends with the same tokens as an uninterrupted run.
"""


from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

PlannedFinish = Literal["stop", "length"]
"""How an uninterrupted emulated response ends: EOS (``"stop"``) or the length cap (``"length"``)."""

_N = NormalDist()


@dataclass(frozen=True, kw_only=True)
class EmulatedParams:
    """Calibration of the emulated engine (times in model seconds)."""

    base_step_s: float = 0.02
    """Time of one decode step (one token for every active sequence) at low batch occupancy."""
    capacity: int = 64
    """Per-instance batch capacity: sequences decoded at ~``base_step_s`` per step before slowdown."""
    alpha: float = 0.0
    """Smooth variant: the step time grows by ``alpha * n / capacity`` below capacity (0 = flat)."""
    prefill_s_per_token: float = 2e-5
    """Prefill cost per prompt (+ partial) token of a newly admitted request."""
    length_median: float | None = None
    """Median of the log-normal length body in tokens; ``None`` = ``median_fraction * max_new_tokens``."""
    median_fraction: float = 0.08
    """Median of the body as a fraction of the request's ``max_new_tokens`` (if ``length_median`` unset)."""
    sigma: float = 1.1
    """Log-space standard deviation of the body (p99/p50 = exp(2.326 sigma) = 12.9 at 1.1)."""
    cap_fraction: float = 0.03
    """Expected fraction of responses that run to the length cap (finish reason ``"length"``)."""
    group_correlation: float = 0.5
    """Share of the log-length variance (and of the runaway latent) common to a GRPO group, in [0, 1]."""
    time_scale: float = 1.0
    """Real seconds slept per model second (0 = no sleeping: logic tests; timestamps are then ~now)."""
    load_s: float = 0.0
    """Model time of one ``load_state_dict`` (weight load)."""
    kv_s_per_token: float = 0.0
    """Decode step time per token of context held by the active sequences (reading their KV cache)."""
    prefill_s_per_token_sq: float = 0.0
    """Quadratic prefill term (causal attention): ``prefill_s_per_token_sq * T**2 / 2`` for ``T`` tokens."""
    kv_capacity_tokens: int = 0
    """Per-instance KV cache capacity in tokens of context (0 = unbounded)."""
    kv_move_s_per_token: float = 0.0
    """Seconds per context token to move a cancelled request's KV cache to another instance of the same
    version (bytes over the network); 0: the KV is not moved and the request is prefilled again there."""
    kv_watermark: float = 0.01
    """Share of the KV capacity a new request must leave free when admitted (vLLM's block-manager
    ``watermark`` default, 0.01): without it, admission fills the cache to one step of headroom and every
    step preempts and re-admits (thrash)."""
    instance_speed_sigma: float = 0.0
    """Log-space spread of per-instance speed (module docstring, "instance imbalance"): the MoE-imbalance
    variant of issue 13, standing for expert-load imbalance that makes some expert-parallel instances
    slower than others (or a heterogeneous fleet). Source: an assumption, not calibrated — no MoE model
    runs here; 0 (a dense model on identical GPUs) everywhere but where a bench sets it."""
    seed: int = 0
    """Seed of every length and token draw."""
    vocab: int = 32000
    """Vocabulary size: pseudo tokens are in ``[3, vocab)``."""
    eos_id: int = 2
    """Token id that ends a ``"stop"`` response."""
    fail_on: tuple[str, ...] = ()
    """Fault injection (a poison prompt): a decode step that holds a request whose id ends with one of
    these (e.g. ``"/p3/1"``) fails, as a real engine failing on one input (its batch-mates fail with it)."""
    fail_exit: bool = False
    """With ``fail_on``: the failure kills the process (``os._exit``) instead of raising."""

    def __post_init__(self) -> None:
        checks = {
            "base_step_s >= 0": self.base_step_s >= 0, "capacity >= 1": self.capacity >= 1,
            "alpha >= 0": self.alpha >= 0, "prefill_s_per_token >= 0": self.prefill_s_per_token >= 0,
            "length_median > 0": self.length_median is None or self.length_median > 0,
            "median_fraction > 0": self.median_fraction > 0, "sigma >= 0": self.sigma >= 0,
            "0 <= cap_fraction < 1": 0 <= self.cap_fraction < 1,
            "0 <= group_correlation <= 1": 0 <= self.group_correlation <= 1,
            "time_scale >= 0": self.time_scale >= 0, "load_s >= 0": self.load_s >= 0,
            "kv_s_per_token >= 0": self.kv_s_per_token >= 0,
            "kv_move_s_per_token >= 0": self.kv_move_s_per_token >= 0,
            "kv_capacity_tokens >= 0": self.kv_capacity_tokens >= 0,
            "prefill_s_per_token_sq >= 0": self.prefill_s_per_token_sq >= 0,
            "0 <= kv_watermark < 1": 0 <= self.kv_watermark < 1,
            "instance_speed_sigma >= 0": self.instance_speed_sigma >= 0,
            "vocab >= 5": self.vocab >= 5, "eos_id >= 0": self.eos_id >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid EmulatedParams: need {', '.join(bad)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EmulatedParams:
        """Build from a mapping; unknown keys are refused (typos must not silently fall back)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown EmulatedParams keys: {unknown}")
        args: dict[str, Any] = {k: tuple(v) if k == "fail_on" else v for k, v in d.items()}
        return cls(**args)


# -- pure timing model -----------------------------------------------------------------------------


def instance_factor(index: int, params: EmulatedParams) -> float:
    """``f_i`` of instance ``index``: how many times as slowly it computes (module docstring)."""
    sd = params.instance_speed_sigma
    if sd == 0:
        return 1.0
    return math.exp(sd * _normal(params.seed, "instance-speed", str(index)) + sd * sd / 2.0)


def for_instance(params: EmulatedParams, index: int) -> EmulatedParams:
    """The parameters instance ``index`` runs with: every decode and prefill cost times
    :func:`instance_factor` (``params`` itself when the spread is 0)."""
    f = instance_factor(index, params)
    if f == 1.0:
        return params
    return replace(params, base_step_s=params.base_step_s * f, kv_s_per_token=params.kv_s_per_token * f,
                   prefill_s_per_token=params.prefill_s_per_token * f,
                   prefill_s_per_token_sq=params.prefill_s_per_token_sq * f)


def step_time(active: int, capacity: int, params: EmulatedParams, context: int = 0) -> float:
    """Model seconds of one decode step with ``active`` sequences holding ``context`` tokens in all
    (formula in the module docstring)."""
    if active <= 0:
        return 0.0
    cap = max(1, capacity)
    weights = params.base_step_s * (1.0 + params.alpha * min(active, cap) / cap) * max(1.0, active / cap)
    return weights + params.kv_s_per_token * max(0, context)


def decode_time(steps: int, active: int, capacity: int, context: int, params: EmulatedParams) -> float:
    """Model seconds of ``steps`` decode steps in a row by the same ``active`` sequences that hold
    ``context`` tokens before the first (each step adds ``active`` tokens of context)."""
    if steps <= 0 or active <= 0:
        return 0.0
    a = step_time(active, capacity, params, 0)
    return steps * a + params.kv_s_per_token * (steps * context + active * steps * (steps - 1) / 2.0)


def decode_steps_within(duration: float, active: int, capacity: int, context: int, params: EmulatedParams) -> int:
    """The most whole steps :func:`decode_time` fits in ``duration`` (the inverse, closed form)."""
    if active <= 0 or duration <= 0:
        return 0
    a = step_time(active, capacity, params, context)  # the first step's time
    q = params.kv_s_per_token * active / 2.0  # time(k) = q k^2 + (a - q) k
    if a <= 0:
        return 1 << 40
    if q <= 0:
        k = int(duration / a)
    else:
        b = a - q
        k = int((-b + math.sqrt(b * b + 4.0 * q * duration)) / (2.0 * q))
    while k > 0 and decode_time(k, active, capacity, context, params) > duration * (1 + 1e-12):
        k -= 1
    while decode_time(k + 1, active, capacity, context, params) <= duration * (1 + 1e-12):
        k += 1
    return k


def prefill_time(tokens: int, params: EmulatedParams) -> float:
    """Model seconds to prefill ``tokens`` prompt (+ partial) tokens admitted together."""
    t = max(0, tokens)
    return params.prefill_s_per_token * t + params.prefill_s_per_token_sq * t * t / 2.0


def modelled_train_s(fixed_s: float, per_token_s: float, tokens: int) -> float:
    """Modelled seconds of one training step on a batch of ``tokens`` prompt + response tokens::

        train_s = fixed_s + per_token_s * tokens

    (forward, backward and optimizer work grow with the tokens; ``fixed_s`` holds what does not: the
    optimizer step over the weights, the version's publication). One home for the simulator's trainer and
    the real trainer's modelled time (``DoraConfig.modelled_train_s_*``, for emulated benches)."""
    return max(0.0, fixed_s) + max(0.0, per_token_s) * max(0, tokens)


def kv_admits(context: int, active: int, request_tokens: int, params: EmulatedParams) -> bool:
    """Whether a request of ``request_tokens`` (prompt + partial) fits next to the ``active`` sequences
    holding ``context`` tokens, leaving free the larger of one more step of all of them and the watermark
    (``kv_watermark * kv_capacity_tokens``), so a sequence just preempted is not admitted straight back.
    An instance with nothing active always admits one."""
    cap = params.kv_capacity_tokens
    headroom = max(active + 1, int(params.kv_watermark * cap))
    return cap <= 0 or active <= 0 or context + request_tokens + headroom <= cap


def kv_steps_left(context: int, active: int, params: EmulatedParams) -> int | None:
    """Decode steps the ``active`` sequences can take before their context exceeds the KV capacity
    (``None``: unbounded). At 0 the most recently admitted sequence must be preempted first."""
    cap = params.kv_capacity_tokens
    if cap <= 0 or active <= 1:  # one sequence alone runs whatever its length
        return None
    return max(0, (cap - context) // active)


def batch_finish_times(
    new_tokens: Sequence[int], prefill_tokens: int, params: EmulatedParams, capacity: int | None = None,
) -> list[float]:
    """Model time at which each sequence of a batch admitted together at t=0 finishes.

    ``new_tokens[i]`` tokens are decoded for sequence ``i`` (0 = finishes at admission, t=0); the
    timeline is exactly the engine's — prefill, then steps of ``step_time(active)`` each — when the
    context terms are off (``kv_s_per_token = prefill_s_per_token_sq = 0``; with them, see
    :func:`decode_time`).
    """
    cap = params.capacity if capacity is None else capacity
    out = [0.0] * len(new_tokens)
    order = sorted((n, i) for i, n in enumerate(new_tokens) if n > 0)
    t, done, k = prefill_time(prefill_tokens, params) if order else 0.0, 0, 0
    while k < len(order):
        n_left = order[k][0]
        t += (n_left - done) * step_time(len(order) - k, cap, params)
        done = n_left
        while k < len(order) and order[k][0] == n_left:
            out[order[k][1]] = t
            k += 1
    return out


# -- pure length / token model ---------------------------------------------------------------------


def _u64(seed: int, domain: str, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}|{domain}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _normal(seed: int, domain: str, key: str) -> float:
    return _N.inv_cdf((_u64(seed, domain, key) + 0.5) / 2.0**64)


def workload_key(request_id: str) -> str:
    """``"p<i>/<k>"`` of a run's ``"<run_id>/p<i>/<k>"`` (its prompt and sample index); any other id as it is."""
    parts = request_id.split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else request_id


def group_of(request_id: str) -> str:
    """The group id of ``"<group_id>/<sample_index>"`` (the whole id when it has no ``/``)."""
    return request_id.rsplit("/", 1)[0] if "/" in request_id else request_id


def planned_length(request_id: str, max_new_tokens: int, params: EmulatedParams) -> tuple[int, PlannedFinish]:
    """The response length (EOS included for ``"stop"``) and finish reason of an uninterrupted run."""
    p, cap = params, max_new_tokens
    median = p.length_median if p.length_median is not None else p.median_fraction * cap
    a, b = math.sqrt(p.group_correlation), math.sqrt(1.0 - p.group_correlation)
    key = workload_key(request_id)
    gid = group_of(key)
    z = a * _normal(p.seed, "len-g", gid) + b * _normal(p.seed, "len-r", key)
    body = max(1, round(median * math.exp(p.sigma * z)))
    if body >= cap:
        return cap, "length"
    if p.sigma > 0:
        tail = 1.0 - _N.cdf((math.log(max(cap - 0.5, 1e-9)) - math.log(median)) / p.sigma)
    else:
        tail = 1.0 if median >= cap - 0.5 else 0.0
    p_force = max(0.0, p.cap_fraction - tail) / max(1e-12, 1.0 - tail)
    if p_force > 0:
        w = a * _normal(p.seed, "run-g", gid) + b * _normal(p.seed, "run-r", key)
        if w > _N.inv_cdf(1.0 - p_force):
            return cap, "length"
    return body, "stop"


def planned_response(
    request_id: str, max_new_tokens: int, params: EmulatedParams,
) -> tuple[list[int], list[float], PlannedFinish]:
    """The full uninterrupted response: token ids, log-probs and finish reason."""
    n, reason = planned_length(request_id, max_new_tokens, params)
    rng = np.random.default_rng([params.seed, _u64(params.seed, "tok", workload_key(request_id))])
    ids = rng.integers(3, params.vocab, size=n)
    ids[ids == params.eos_id] = 3 if params.eos_id != 3 else 4
    lps = -np.minimum(1e-3 + rng.exponential(0.35, size=n), 2.999)
    if reason == "stop":
        ids[-1] = params.eos_id
    return [int(x) for x in ids], [float(x) for x in lps], reason


def sample_lengths(
    n: int, params: EmulatedParams, max_new_tokens: int, group_size: int = 8,
) -> npt.NDArray[np.int64]:
    """Lengths of ``n`` requests ``"g<j>/<k>"`` in groups of ``group_size`` (for tests and plots)."""
    return np.array([planned_length(f"g{i // group_size}/{i % group_size}", max_new_tokens, params)[0]
                     for i in range(n)], dtype=np.int64)


