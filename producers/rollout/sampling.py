"""Sampling from a stream per request: a request's draws do not depend on its batch or its instance.

The ``i``-th response token of request ``r`` (``i`` counts the response's tokens, partial ones
included) is drawn with one uniform

    ``u(seed, r, i) = (top 53 bits of blake2b("seed:r:i", 8 bytes) + 0.5) / 2**53``  (in ``(0, 1)``)

by inverse CDF over the sampling distribution ``p = softmax(logits / temperature)``:

    ``token = min{t : cdf[t] > u * cdf[V - 1]}``, ``cdf = cumsum(p)`` in float64 per row.

That is an exact draw from ``p`` (the ``cdf`` steps only at tokens of positive probability). ``u``
depends on ``(seed, r, i)`` alone, so a request moved to another instance of the same run (same
``seed``) mid-decode, or decoded in a batch of another size, draws the same token wherever the
logits agree (they differ by float rounding between batch shapes; a token flips only when ``u``
falls within that rounding of a ``cdf`` step). Every instance of a run samples with the run's seed:
the request id, not the instance, makes the streams differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

_SCALE = 2.0 ** -53


def uniform(seed: int, request_id: str, index: int) -> float:
    """``u(seed, request_id, index)`` of the module docstring, in ``(0, 1)``."""
    digest = hashlib.blake2b(f"{seed}:{request_id}:{index}".encode(), digest_size=8).digest()
    return ((int.from_bytes(digest, "big") >> 11) + 0.5) * _SCALE


def sample(logp: torch.Tensor, seed: int, request_ids: Sequence[str], indices: Sequence[int]) -> torch.Tensor:
    """One token per row of ``logp`` (``[B, V]`` log-probabilities of the sampling distribution), row
    ``b`` from the stream of ``request_ids[b]`` at response index ``indices[b]``; returns ``[B, 1]``."""
    u = torch.tensor([uniform(seed, r, i) for r, i in zip(request_ids, indices, strict=True)],
                     dtype=torch.float64, device=logp.device)
    cdf = logp.exp().double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logp.shape[-1] - 1)
