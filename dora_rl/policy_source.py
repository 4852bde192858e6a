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

from dora_rl.infra.kafka_dist import dora_home


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
