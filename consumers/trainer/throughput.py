"""How much the trainer computes at once, and how well it uses the device (pure arithmetic, no I/O).

- :func:`micro_token_budget`: the tokens of one micro-batch (forward + backward at once) that fit in
  ``fraction`` of a device's memory once the training state is placed:

      state  = params * (4 master + 4 grad + 8 AdamW)                      bytes
      per_tok = layers * (8 * hidden + 4 * intermediate) * act_bytes        (saved activations)
              + vocab * 14                                                  (logits, fp32 log-softmax, grads)
      budget = clamp(floor((fraction * total - state) / per_tok), lo, hi), rounded down to a multiple of 256

  ``act_bytes`` is 2 under bf16 autocast and 4 in fp32; gradient checkpointing keeps one layer's
  activations plus a ``hidden`` input per layer. The estimate is deliberately coarse (the fraction is
  the margin): the unit test pins the formula, the GPU check measures the memory it really takes.
- :func:`resolved_micro_tokens`: ``config.micro_tokens`` when set, else the budget of the device's
  *total* memory (never its free memory: the same device must give the same split, since the split
  enters float rounding and replay re-runs it), and 1024 on the CPU (a CPU update is compute-bound;
  keeping the historical split keeps every CPU figure and replay bit-exact).
- :func:`model_flops_per_token` ``= 6 * params`` (forward 2, backward 4; attention's quadratic term
  left out) and :func:`mfu` ``= flops_per_token * tokens / seconds / peak``, with ``peak`` the dense bf16
  (or TF32 for fp32) tensor-core rate of a known device from :data:`PEAK_FLOPS`, else None.
"""

from __future__ import annotations

from typing import Any

import torch

CPU_MICRO_TOKENS = 1024
"""The micro-batch budget on a CPU (see the module docstring)."""

PEAK_FLOPS: dict[str, tuple[float, float]] = {
    # device name fragment -> (bf16 dense, tf32 dense) FLOP/s, from the vendors' datasheets
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "H800": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10G": (70e12, 35e12),
}


def micro_token_budget(total_bytes: int, params: int, hidden: int, intermediate: int, layers: int, vocab: int,
                       bf16: bool, checkpointing: bool = False, fraction: float = 0.5, lo: int = 1024,
                       hi: int = 65_536) -> int:
    """Tokens of one micro-batch (see the module docstring for the formula)."""
    act = 2 if bf16 else 4
    state = params * 16
    per_layer = hidden * act if checkpointing else (8 * hidden + 4 * intermediate) * act
    per_tok = layers * per_layer + (8 * hidden + 4 * intermediate) * act * int(checkpointing) + vocab * 14
    room = fraction * total_bytes - state
    budget = int(room // per_tok) if room > 0 else lo
    return max(lo, min(hi, budget // 256 * 256))


def _shape(model: torch.nn.Module) -> dict[str, int]:
    cfg: Any = getattr(model, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    return dict(hidden=hidden, intermediate=int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden),
                layers=int(getattr(cfg, "num_hidden_layers", 1) or 1), vocab=int(getattr(cfg, "vocab_size", 0) or 0))


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counted once; a sharded one by its full size)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def resolved_micro_tokens(configured: int, model: torch.nn.Module, bf16: bool, checkpointing: bool) -> int:
    """``configured`` if > 0, else the budget of the model's device (see the module docstring)."""
    if configured > 0:
        return configured
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return CPU_MICRO_TOKENS
    total = int(torch.cuda.get_device_properties(dev).total_memory)
    return micro_token_budget(total, parameter_count(model), bf16=bf16, checkpointing=checkpointing, **_shape(model))


def model_flops_per_token(model: torch.nn.Module) -> float:
    """Training FLOPs per token: ``6 * params``."""
    return 6.0 * parameter_count(model)


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The device's dense tensor-core peak (bf16, or TF32 for fp32), None for a CPU or an unknown device."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (bf, tf) in PEAK_FLOPS.items():
        if fragment in name:
            return bf if bf16 else tf
    return None


def mfu(flops_per_token: float, tokens: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None without a known peak or time."""
    if peak is None or seconds <= 0:
        return None
    return flops_per_token * tokens / seconds / peak
