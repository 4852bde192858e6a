"""Costs of a real deployment derived from datasheets and model configs, as pure functions.

The emulated engine and the simulator take their costs as :class:`~dora_rl.core.emulation.EmulatedParams`
(decode step, KV reads, prefill, KV capacity, weight load) plus the trainer's seconds per token; this
module derives those numbers from an accelerator, a model, a parallel layout and a few efficiencies,
so every parameter has a source written next to it. Formulas (``P`` parameters, ``B`` bytes per
parameter, ``TP`` GPUs per rollout instance, ``BW`` HBM bandwidth, ``F`` dense bf16 FLOP/s):

* weights read once per decode step: ``w = P * B / (TP * BW * eta_mem) + overhead``;
* decode compute at ``C`` sequences: ``2 * P * C / (TP * F * mfu_decode)``, so
  ``alpha = compute(C) / w`` in ``step = w * (1 + alpha * n / C)``;
* KV bytes per token ``2 * layers * kv_heads * head_dim * B``; read per step:
  ``kv_s_per_token = kv_bytes / (TP * BW * eta_mem)``;
* KV capacity: ``(TP * HBM * mem_fraction - P * B) / kv_bytes`` tokens per instance;
* prefill: linear ``2 * P / (TP * F * mfu_prefill)`` per token, attention ``4 * layers * hidden /
  (TP * F * mfu_prefill)`` per token pair (``prefill_s_per_token_sq``, causal: ``T**2 / 2`` pairs);
* training per token: ``flops_per_param_token * P / (N_train * F * mfu_train)`` with 6 (forward +
  backward) + 2 (the old policy's log-probs recomputed) = 8 flops per parameter and token;
* a version switch: the weights pulled over the instance's network, ``P * B / (TP * net_bw)``, plus
  loading them; colocated (sync, same GPUs) it is a reshard over NVLink;
* a KV move (a request handed to another instance of its version, ``consolidate``): its context's KV
  bytes over the network, ``kv_bytes_per_token / (TP * net_bw)`` per token (``kv_move_s_per_token``);
* the per-step overhead at another TP than the frozen one's 4 (:func:`step_overhead_s`): the frozen
  ``step_overhead_s`` (TP 4) plus the change in the TP all-reduces, 2 per layer of ``seqs * hidden * B``
  bytes, each as a ring: ``2 (TP - 1)`` hops of ``hop_latency_s`` and ``2 (TP - 1) / TP`` of the message
  per GPU over NVLink (:func:`allreduce_s_per_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .emulation import EmulatedParams


@dataclass(frozen=True)
class Accelerator:
    """One GPU's datasheet figures."""

    name: str
    bf16_flops: float
    """Dense bf16 FLOP/s (no sparsity)."""
    hbm_bytes: float
    hbm_bw: float
    """HBM bytes/s."""
    nvlink_bw: float
    """NVLink bytes/s per GPU (one direction)."""
    net_bw: float
    """Scale-out network bytes/s per GPU (one NIC per GPU)."""
    source: str


H800 = Accelerator(
    "H800 SXM5", bf16_flops=989.4e12, hbm_bytes=80e9, hbm_bw=3.35e12, nvlink_bw=200e9, net_bw=50e9,
    source="NVIDIA H100 SXM5 datasheet (H800: same SMs, HBM3 80 GB at 3.35 TB/s, 989.4 TFLOPS dense bf16; "
           "NVLink cut to 400 GB/s bidirectional = 200 GB/s each way); 8x 400 Gb/s InfiniBand per node "
           "(one 50 GB/s NIC per GPU, the usual H800 node)")


@dataclass(frozen=True)
class Model:
    """A decoder's size as its config.json states it."""

    name: str
    params: float
    """Total parameters."""
    active_params: float
    """Parameters used per token (= params for a dense model; the active experts' for a MoE)."""
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


QWEN25_32B = Model(
    "Qwen2.5-32B", params=32.5e9, active_params=32.5e9, layers=64, hidden=5120, kv_heads=8, head_dim=128,
    source="Qwen/Qwen2.5-32B config.json (64 layers, hidden 5120, 40 heads, 8 KV heads, head_dim 128) "
           "and model card (32.5B parameters); bf16")


@dataclass(frozen=True)
class Efficiencies:
    """Achieved fractions of the datasheet. Defaults are typical published figures; ``train_mfu`` is
    the one fitted (on the 64-GPU paper rows) and says so where it is used."""

    mem_eff: float = 0.75
    """Achieved / peak HBM bandwidth in decode (vLLM on H100-class GPUs reaches 70-80%)."""
    decode_mfu: float = 0.5
    """Achieved / peak FLOP/s of a full decode batch's matmuls."""
    prefill_mfu: float = 0.5
    """Achieved / peak FLOP/s in prefill (compute-bound, large GEMMs)."""
    train_mfu: float = 0.35
    """Achieved / peak FLOP/s of the trainer (long-sequence RL training with FSDP/Megatron: 30-45%)."""
    step_overhead_s: float = 0.003
    """Per decode step fixed cost: TP all-reduces (2 per layer), sampling, scheduling (vLLM, TP=4)."""
    kv_mem_fraction: float = 0.85
    """vLLM ``gpu_memory_utilization``: the share of HBM for weights + KV cache."""


FROZEN_TP = 4
"""The TP at which ``Efficiencies.step_overhead_s`` was set (and every paper-setup figure measured)."""


def allreduce_s_per_step(acc: Accelerator, model: Model, tp: int, seqs: int, hop_latency_s: float) -> float:
    """Seconds of one decode step's TP all-reduces at ``seqs`` sequences, modelled as rings (module
    docstring); 0 at TP 1. An upper bound where the all-reduce is one-shot over NVSwitch (vLLM's custom
    all-reduce for small messages), whose latency grows less with TP than a ring's."""
    if tp <= 1:
        return 0.0
    message = seqs * model.hidden * model.bytes_per_param
    one = 2 * (tp - 1) * hop_latency_s + 2 * (tp - 1) / tp * message / acc.nvlink_bw
    return 2 * model.layers * one


def step_overhead_s(acc: Accelerator, model: Model, eff: Efficiencies, tp: int, seqs: int,
                    hop_latency_s: float = 0.0) -> float:
    """The per-decode-step overhead at ``tp``: the frozen ``eff.step_overhead_s`` (set for TP
    :data:`FROZEN_TP`, so ``tp == 4`` gives it exactly) plus what the all-reduces cost more (or less) at
    ``tp`` than at TP 4 (:func:`allreduce_s_per_step`). ``hop_latency_s`` is not known from a datasheet: the
    TP sensitivity bench sweeps it (``bench/paper_tp.py``)."""
    if tp == FROZEN_TP:
        return eff.step_overhead_s
    extra = (allreduce_s_per_step(acc, model, tp, seqs, hop_latency_s)
             - allreduce_s_per_step(acc, model, FROZEN_TP, seqs, hop_latency_s))
    return max(0.0, eff.step_overhead_s + extra)


def rollout_params(acc: Accelerator, model: Model, eff: Efficiencies, tp: int, max_num_seqs: int,
                   seed: int = 0, hop_latency_s: float = 0.0, **lengths: float) -> EmulatedParams:
    """The emulated engine's costs for one rollout instance of ``tp`` GPUs (formulas in the module
    docstring); ``lengths`` are :class:`EmulatedParams`' length-model fields; ``hop_latency_s`` matters only
    at a TP other than 4 (:func:`step_overhead_s`)."""
    bw = tp * acc.hbm_bw * eff.mem_eff
    flops_decode = tp * acc.bf16_flops * eff.decode_mfu
    flops_prefill = tp * acc.bf16_flops * eff.prefill_mfu
    w = model.weight_bytes / bw + step_overhead_s(acc, model, eff, tp, max_num_seqs, hop_latency_s)
    compute = 2.0 * model.active_params * max_num_seqs / flops_decode
    kv_tokens = int((tp * acc.hbm_bytes * eff.kv_mem_fraction - model.weight_bytes) / model.kv_bytes_per_token)
    if kv_tokens <= 0:
        raise ValueError(f"{model.name} does not fit {tp} x {acc.name} at memory fraction {eff.kv_mem_fraction}")
    return EmulatedParams(
        base_step_s=w, capacity=max_num_seqs, alpha=compute / w, kv_s_per_token=model.kv_bytes_per_token / bw,
        prefill_s_per_token=2.0 * model.active_params / flops_prefill,
        prefill_s_per_token_sq=4.0 * model.layers * model.hidden / flops_prefill,
        kv_capacity_tokens=kv_tokens, kv_move_s_per_token=model.kv_bytes_per_token / (tp * acc.net_bw),
        load_s=switch_seconds(acc, model, tp), time_scale=0.0, seed=seed,
        **lengths)  # type: ignore[arg-type]


def train_seconds_per_token(acc: Accelerator, model: Model, eff: Efficiencies, gpus: int,
                            flops_per_param_token: float = 8.0) -> float:
    """Trainer seconds per (prompt + response) token on ``gpus`` GPUs."""
    return flops_per_param_token * model.active_params / (gpus * acc.bf16_flops * eff.train_mfu)


def switch_seconds(acc: Accelerator, model: Model, tp: int, colocated: bool = False) -> float:
    """A rollout instance's weight switch: pulled over its ``tp`` NICs from a peer or the trainer
    (disaggregated), or resharded over NVLink on the same GPUs (colocated)."""
    bw = tp * (acc.nvlink_bw if colocated else acc.net_bw)
    return model.weight_bytes / bw
