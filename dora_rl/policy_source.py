"""Where a role gets the initial policy from: ``tiny:<size>``, ``smollm2``, or a local HF folder.

``tiny:<size>`` is built deterministically from the run seed into ``$DORA_HOME/models`` (every
role on every machine builds the same initial weights, so only *updated* weights ever move).
Building writes into a temporary folder renamed into place, so concurrent roles never see a
half-written model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dora_rl.infra.broker.dist import dora_home


def models_dir() -> Path:
    """``$DORA_HOME/models``."""
    path = dora_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(spec: str, seed: int = 0) -> Path:
    """A local Hugging Face folder for ``spec`` (built or converted on first use)."""
    from dora_rl import modeling

    if spec.startswith("tiny:"):
        size = spec.split(":", 1)[1] or "1m"
        target = models_dir() / f"tiny-{size}-seed{seed}"
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=models_dir()))
            modeling.build_tiny_model(tmp, size=size, seed=seed)
            try:
                os.rename(tmp, target)
            except OSError:  # another role built it first
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    if spec == "smollm2":
        return modeling.prepare_smollm2(models_dir())
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {spec!r}: no config.json in {path} (expected tiny:<size>, smollm2, "
                                "or a local Hugging Face model folder)")
    return path


def model_vocab_size(spec: str, seed: int = 0) -> int | None:
    """The vocabulary size in ``spec``'s ``config.json`` (a ``tiny:`` or ``smollm2`` model is built first), or
    None when ``spec`` is a path that does not exist on this host (the model lives only where the trainer
    and the engines run)."""
    import json

    if not (spec.startswith("tiny:") or spec == "smollm2" or (Path(spec).expanduser() / "config.json").exists()):
        return None
    return int(json.loads((resolve_model(spec, seed) / "config.json").read_text())["vocab_size"])
