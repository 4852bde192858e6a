"""The trainer's numeric precision: one context every update and evaluation runs under (torch only, so
``bench/gpu_check.py`` can use it on a machine with nothing but torch and transformers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dora_rl.config import DoraConfig
from dora_rl.modeling import attention_kernels


@contextmanager
def precision(config: DoraConfig) -> Iterator[None]:
    """bf16 autocast on ``config.device`` when ``config.dtype == "bf16"`` (the weights, gradients and
    AdamW state stay fp32: the master copy); a no-op for fp32.

    Invariant: every forward inside the context computes with the weights as they are at that forward.
    Autocast's weight cache (``cache_enabled``) keeps the bf16 copy of each fp32 leaf weight until the
    context exits, which is wrong here: the context spans a whole update of several optimizer steps, and
    with the cache every minibatch after the first computed with the bf16 weights the update began with
    (the PPO ratio stayed 1; measured on an H100: approx KL 0.0008 against 0.036, the update 0.64 of its
    own size off fp32). So the cache is off: each forward casts the weights it uses (docs/decisions/0042).
    Attention runs on :func:`~dora_rl.modeling.attention_kernels` (no cuDNN attention on CUDA).
    """
    with torch.autocast(device_type=torch.device(config.device).type, dtype=torch.bfloat16,
                        enabled=config.dtype == "bf16", cache_enabled=False), attention_kernels(config.device):
        yield
