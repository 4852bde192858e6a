"""Durable trainer checkpoints: one per announced version, written before its announcement.

Invariant (the trainer keeps it, :mod:`dora_rl.consumers.trainer.role`): version ``v`` is announced
on ``dora.policy.versions`` only after :func:`save` of ``v`` returned, and the announcement's
``checkpoint_uri`` names that checkpoint. So a restarted trainer finds, from the topic alone, the
newest announced version and a checkpoint holding exactly its weights (same bytes, hence the same
checksums) together with everything the next update needs: optimizer moments, LR-schedule position
and the step. It never announces a version twice with two sets of weights, and never re-applies a
batch (the step in the checkpoint says which batch comes next).

Replay checkpoints (:func:`save_replayable`, every ``checkpoint_every`` versions, version 0 and the
last one included, under ``$DORA_HOME/runs/<run>/checkpoints/v<version:06d>/``, never pruned): a
loadable Hugging Face folder of the policy plus the same ``trainer.pt`` and ``COMPLETE``, so
:func:`load` restores from either kind and ``dora-rl replay retrain`` re-executes any step from the
nearest one at or below it (docs/decisions/0020).

Layout: ``<root>/v<version:06d>-<incarnation>/`` holds ``model.safetensors`` (weights, tied tensors
once), ``trainer.pt`` (optimizer and scheduler state dicts, step) and ``COMPLETE`` (written last). The root
is a :class:`~dora_rl.infra.storage.StorageRoot`: ``<run dir>/trainer-state`` by default, or
``<checkpoint_url>/<run id>/trainer-state`` on shared storage (any fsspec URL), so a trainer restarted on
another host restores from it. The incarnation (a fresh id per trainer process) keeps a zombie predecessor
from ever overwriting a checkpoint its replacement announced; on local disk a checkpoint is renamed into
place, on an object store its marker is written last: either way a crash leaves the whole checkpoint or
one without its marker, which no reader takes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from dora_rl.infra.storage import COMPLETE, StorageRoot, commit_local, local_tmp
from dora_rl.modeling import load_weights, state_dict_for_transfer


def entry_name(version: int, incarnation: str) -> str:
    return f"v{version:06d}-{incarnation}"


def _trainer_state(optimizer: torch.optim.Optimizer, scheduler: Any, step: int, version: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": int(step),
                "version": int(version)}, buf)
    return buf.getvalue()


def save(root: StorageRoot, version: int, incarnation: str, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> str:
    """Write the checkpoint of ``version`` whole; returns its URI (the one the announcement names)."""
    weights = {k: v.detach().contiguous() for k, v in state_dict_for_transfer(model, clone=False).items()}
    return root.write(entry_name(version, incarnation),
                      {"model.safetensors": save_bytes(weights),
                       "trainer.pt": _trainer_state(optimizer, scheduler, step, version)})


def replay_dir(root: Path, version: int) -> Path:
    """Directory of the replay checkpoint of ``version`` under ``root`` (``<run dir>/checkpoints``)."""
    return root / f"v{version:06d}"


def save_replayable(root: Path, version: int, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> Path:
    """Write the replay checkpoint of ``version`` atomically: a Hugging Face folder of the policy (its
    ``model.safetensors`` holds the same tensors as :func:`save`'s) plus the trainer state; returns it."""
    final = replay_dir(root, version)
    root.mkdir(parents=True, exist_ok=True)
    tmp = local_tmp(final)
    model.save_pretrained(tmp)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if not (tmp / "model.safetensors").exists():
        raise RuntimeError(f"saving {final}: the policy was written in shards, not as one model.safetensors")
    (tmp / "trainer.pt").write_bytes(_trainer_state(optimizer, scheduler, step, version))
    commit_local(tmp, final)
    return final


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Restore weights, optimizer and scheduler from the local checkpoint folder ``path``; returns its step."""
    return load_from(StorageRoot(path.parent), str(path), model, optimizer, scheduler)


def load_from(root: StorageRoot, uri: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: Any) -> int:
    """Restore weights, optimizer and scheduler from checkpoint ``uri`` under ``root``; returns its step.
    ValueError when ``uri`` is outside ``root``; FileNotFoundError when it has no marker."""
    load_weights_from(root, uri, model)
    state = torch.load(io.BytesIO(root.read(uri, "trainer.pt")), weights_only=True)  # tensors, never code
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def load_weights_from(root: StorageRoot, uri: str, model: torch.nn.Module) -> None:
    """Weights of checkpoint ``uri`` under ``root`` into ``model`` (to serve an older live version again)."""
    load_weights(model, load_bytes(root.read(uri, "model.safetensors")))


def prune(root: StorageRoot, keep_from: int) -> None:
    """Delete checkpoints of versions below ``keep_from`` (no longer live, never needed again)."""
    for name in root.names():
        head = name.split("-", 1)[0]
        if head.startswith("v") and head[1:].isdigit() and int(head[1:]) < keep_from:
            root.delete(name)


def complete_versions(root: Path) -> dict[int, Path]:
    """Every complete checkpoint under ``root`` (either layout) by version; the newest directory wins
    where one version has several (a restarted trainer's incarnations hold the same bytes)."""
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime):
        head = d.name.split("-", 1)[0]
        if head.startswith("v") and head[1:].isdigit() and (d / COMPLETE).exists():
            out[int(head[1:])] = d
    return out
