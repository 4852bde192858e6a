"""What a benchmark result was measured on: the commit (and whether the tree had local changes) and the machine
(CPU model and count: timed figures and some numerics depend on it, decision 0075)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    """``{"cpu": <model name>, "cpus": <count>}`` of this host (``platform.processor()`` where ``/proc`` is absent)."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return {"cpu": names[0] if names else platform.processor(), "cpus": os.cpu_count()}


def provenance() -> dict[str, Any]:
    """``{"commit": <sha>, "dirty": bool, "machine": {...}}`` of the repository and host this benchmark runs on."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                "machine": machine()}
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"commit": None, "dirty": None, "machine": machine(), "error": str(exc)}


def write_result(prefix: str, out: dict[str, Any], explicit: str | None = None) -> Path:
    """Write a result as JSON to ``explicit``, else to ``bench/results/<prefix>-<UTC timestamp>.json``
    (the plot, if any, goes next to it with ``.png``); returns the path."""
    import json
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(explicit) if explicit else REPO / "bench" / "results" / f"{prefix}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return path


def config_mode(label: str) -> str:
    """The ``DoraConfig.mode`` a bench's mode label runs. The benches' ``partial`` is the unbounded baseline
    every committed figure labelled "partial" measured (``partial_unbounded`` since ``partial`` is held to
    the run's bound, decision 0047); ``partial_bounded`` runs the bounded one, not in their sweeps yet (issue 29)."""
    return {"partial": "partial_unbounded", "partial_bounded": "partial"}.get(label, label)
