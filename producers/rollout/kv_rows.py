"""A decoding request's KV rows: what moves when a request continues on another instance.

Between two decode steps of :class:`~.torch_engine.TorchEngine` a request is fully described by its
tokens (prompt + response so far: the :class:`~.engine.GenRequest` carries them), the keys and
values its tokens wrote in every layer, and the logits of its next token. :class:`KvRows` holds the
last two. C1 makes a move exact: version ``v``'s KV of a token sequence is the same on any instance
holding ``v``, so an instance of the same version that imports the rows continues the request as if
it had never left (sampling: :mod:`.sampling`).

Invariants of a :class:`KvRows` of ``n`` tokens: ``keys[l]`` and ``values[l]`` are ``[H, n, D]`` for
every layer ``l`` (keys after the rotary embedding, as the cache holds them: positions ``0..n-1``),
all of one dtype; ``logits`` is ``[V]``; ``n == len(prompt_ids) + len(partial_ids)`` of the request
that carries it (checked on import, :func:`unfit`).

Over the weight channel (:func:`to_tensors` / :func:`from_tensors`) the rows of several requests
travel as one state dict, so a move gets the channel's token check, per-bucket checksums against the
manifest and every transport (UCX, TCP, file) for free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .torch_batch import Batch, SlackLayer, mergeable, new_cache


@dataclass(frozen=True)
class KvRows:
    """One request's KV cache rows and next-token logits (see the module docstring)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    logits: torch.Tensor

    @property
    def length(self) -> int:
        """Tokens the rows cover (prompt + response so far)."""
        return int(self.keys[0].shape[1]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.logits))


def export_row(batch: Batch, b: int) -> KvRows:
    """Copy batch row ``b``'s KV rows and logits out of ``batch`` (between decode steps)."""
    width = batch.mask.shape[1]
    n = int(batch.mask[b].sum())
    assert bool(batch.mask[b, width - n:].all()), "a row's tokens are the right end of the window"
    keys, values = [], []
    for layer in batch.cache.layers:
        assert isinstance(layer, SlackLayer) and layer.keys is not None and layer.values is not None
        assert layer.keys.shape[2] == width, "the cache window and the mask cover the same columns"
        keys.append(layer.keys[b, :, width - n:].clone())
        values.append(layer.values[b, :, width - n:].clone())
    return KvRows(tuple(keys), tuple(values), batch.logits[b].clone())


def unfit(model: PreTrainedModel, kv: KvRows, tokens: int) -> str | None:
    """Why ``kv`` cannot join ``model``'s batch for a request of ``tokens`` tokens, or None if it can."""
    cache = new_cache(model)
    if not mergeable(cache):
        return "cache"
    layers = len(cache.layers)
    if len(kv.keys) != layers or len(kv.values) != layers:
        return "layers"
    if kv.length != tokens:
        return "length"
    p = next(model.parameters())
    shape = kv.keys[0].shape
    if any(t.shape != shape or t.dtype != p.dtype for t in (*kv.keys, *kv.values)):
        return "shape"
    heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if (shape[0], shape[2]) != (heads, head_dim):
        return "shape"
    out = model.get_output_embeddings()
    vocab = out.weight.shape[0] if out is not None else model.config.vocab_size
    if kv.logits.shape != (vocab,):
        return "vocab"
    return None


def import_rows(model: PreTrainedModel, kvs: list[KvRows], rows: list[int], static: bool = False) -> Batch:
    """A batch of the requests ``rows`` (row ``j`` continues from ``kvs[j]``), left-padded to the
    longest, in the state a prefill of their tokens leaves (no forward run)."""
    dev = next(model.parameters()).device
    width = max(kv.length for kv in kvs)
    mask = torch.zeros((len(kvs), width), dtype=torch.long, device=dev)
    for j, kv in enumerate(kvs):
        mask[j, width - kv.length:] = 1
    cache = new_cache(model, static)
    for li, layer in enumerate(cache.layers):
        assert isinstance(layer, SlackLayer), "rows join only caches of SlackLayers (unfit checks the model)"
        layer.update(_left_padded([kv.keys[li] for kv in kvs], width, dev),
                     _left_padded([kv.values[li] for kv in kvs], width, dev))
    last_pos = torch.tensor([[kv.length - 1] for kv in kvs], dtype=torch.long, device=dev)
    logits = torch.stack([kv.logits.to(dev) for kv in kvs])
    return Batch(list(rows), cache, logits, mask, last_pos)


def _left_padded(rows: list[torch.Tensor], width: int, dev: torch.device) -> torch.Tensor:
    heads, _, dim = rows[0].shape
    out = rows[0].new_zeros((len(rows), heads, width, dim), device=dev)
    for j, t in enumerate(rows):
        out[j, :, width - t.shape[1]:] = t.to(dev)
    return out


def to_tensors(moved: Mapping[str, KvRows]) -> dict[str, torch.Tensor]:
    """The rows of several requests as one state dict for the weight channel (names
    ``"<request id>|k<layer>"``, ``"|v<layer>"``, ``"|logits"``)."""
    out: dict[str, torch.Tensor] = {}
    for rid, kv in moved.items():
        for li, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
            out[f"{rid}|k{li}"], out[f"{rid}|v{li}"] = k.contiguous(), v.contiguous()
        out[f"{rid}|logits"] = kv.logits.contiguous()
    return out


def from_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, KvRows]:
    """Inverse of :func:`to_tensors`; a name of another shape raises ``ValueError``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        rid, sep, field = name.rpartition("|")
        if not sep or not (field == "logits" or (field[:1] in "kv" and field[1:].isdigit())):
            raise ValueError(f"not a KV-rows tensor name: {name!r}")
        parts.setdefault(rid, {})[field] = t
    out = {}
    for rid, fields in parts.items():
        layers = sum(1 for f in fields if f.startswith("k"))
        try:
            keys = tuple(fields[f"k{i}"] for i in range(layers))
            values = tuple(fields[f"v{i}"] for i in range(layers))
            out[rid] = KvRows(keys, values, fields["logits"])
        except KeyError as e:
            raise ValueError(f"{rid}: KV rows without {e.args[0]!r}") from None
        if len(fields) != 2 * layers + 1:
            raise ValueError(f"{rid}: KV rows with {len(fields)} tensors for {layers} layers")
    return out
