"""Which attention kernels a decode step may use (torch's SDPA backends), per device.

On CUDA, SDPA picks cuDNN attention for bf16 when it can. Its host-side planning costs ~4.4 ms per call
whenever the key length changes, which during decode is every step (measured on an H200: a 10M model's
decode step 78 ms in bf16 against 13 ms in fp32, where the memory-efficient kernel ran). Decoding
therefore allows flash, memory-efficient and math attention, never cuDNN. On a CPU the choice is
torch's own (the context is empty).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Allowed on CUDA, in torch's order of preference (cuDNN attention left out)."""


def decode_attention(device: torch.device | str) -> AbstractContextManager[None]:
    """The context a generation call on ``device`` runs in (see the module docstring)."""
    if torch.device(device).type == "cuda":
        return sdpa_kernel(DECODE_BACKENDS)
    return nullcontext()
