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

Layout: ``<dir>/v<version:06d>-<incarnation>/`` holds ``model.safetensors`` (weights, tied tensors
once), ``trainer.pt`` (optimizer and scheduler state dicts, step) and ``COMPLETE`` (written last).
The incarnation (a fresh id per trainer process) keeps a zombie predecessor from ever overwriting a
checkpoint its replacement announced. A checkpoint is written into a temporary sibling directory,
every file fsync'd, then renamed into place and the parent directory fsync'd: a crash leaves either
the whole checkpoint or none.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dora_rl.modeling import load_weights, state_dict_for_transfer

COMPLETE = "COMPLETE"


def checkpoint_dir(root: Path, version: int, incarnation: str) -> Path:
    return root / f"v{version:06d}-{incarnation}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, version: int, incarnation: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, step: int) -> Path:
    """Write the checkpoint of ``version`` atomically; returns its directory (the announced URI)."""
    final = checkpoint_dir(root, version, incarnation)
    tmp = root / f".tmp-v{version:06d}-{incarnation}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().contiguous() for k, v in state_dict_for_transfer(model, clone=False).items()}
    save_file(weights, str(tmp / "model.safetensors"))
    _commit(tmp, final, version, optimizer, scheduler, step)
    return final


def _commit(tmp: Path, final: Path, version: int, optimizer: torch.optim.Optimizer, scheduler: Any,
            step: int) -> None:
    """Add the trainer state and the marker to ``tmp``, make it durable, rename it to ``final``."""
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": int(step),
                "version": int(version)}, tmp / "trainer.pt")
    (tmp / COMPLETE).write_text(str(version))
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():  # a restarted trainer saving a version again: same step, same bytes
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(final.parent)


def replay_dir(root: Path, version: int) -> Path:
    """Directory of the replay checkpoint of ``version`` under ``root`` (``<run dir>/checkpoints``)."""
    return root / f"v{version:06d}"


def save_replayable(root: Path, version: int, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> Path:
    """Write the replay checkpoint of ``version`` atomically: a Hugging Face folder of the policy (its
    ``model.safetensors`` holds the same tensors as :func:`save`'s) plus the trainer state; returns it."""
    final = replay_dir(root, version)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if not (tmp / "model.safetensors").exists():
        raise RuntimeError(f"saving {final}: the policy was written in shards, not as one model.safetensors")
    _commit(tmp, final, version, optimizer, scheduler, step)
    return final


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Restore weights, optimizer and scheduler from checkpoint ``path``; returns its step."""
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing (no {COMPLETE} marker)")
    load_weights(model, load_file(str(path / "model.safetensors")))
    state = torch.load(path / "trainer.pt", weights_only=True)  # tensors and plain values: never code
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def within(root: Path, uri: str | Path) -> Path:
    """``uri`` resolved, if it lies under ``root``; ValueError otherwise. A restore reads only under the run's
    own checkpoint root, whatever location a record (an announcement, an archive) names."""
    path, base = Path(uri).resolve(), root.resolve()
    if not path.is_relative_to(base):
        raise ValueError(f"checkpoint {uri} is outside this run's checkpoint root {base}: not read")
    return path


def load_weights_only(path: Path, model: torch.nn.Module) -> None:
    """Weights of checkpoint ``path`` into ``model`` (to serve an older live version again)."""
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing (no {COMPLETE} marker)")
    load_weights(model, load_file(str(path / "model.safetensors")))


def prune(root: Path, keep_from: int) -> None:
    """Delete checkpoints of versions below ``keep_from`` (no longer live, never needed again)."""
    if not root.exists():
        return
    for d in root.iterdir():
        head = d.name.split("-", 1)[0]
        if head.startswith("v") and head[1:].isdigit() and int(head[1:]) < keep_from:
            shutil.rmtree(d, ignore_errors=True)


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
