"""Named crash points: a role dies (``os._exit``, as abruptly as SIGKILL) at an exact place, once.

For fault-injection runs only (``bench/chaos``): a crash point fires when its name is listed in
``DORA_CRASH_POINTS`` (comma-separated) and its marker file does not exist yet in
``DORA_CRASH_DIR``; the marker is written (and fsync'd) just before dying, so the restarted role runs
through the same place and the point fires once per run. With the variable unset (always, outside
fault injection) a crash point is one dictionary lookup.

Points: ``trainer.after_update`` (weights updated, nothing announced), ``trainer.before_commit``
(announcement produced in the open transaction, not committed), ``<processor>.before_commit``
for ``orchestrator``, ``assembler`` and ``scorer`` (a stream processor's outputs — for the assembler
a batch — and its snapshot produced, the transaction not committed), ``rollout.in_flight`` (a rollout
instance in the middle of a generation call, right after producing a token chunk), ``rollout.kv_transfer``
(an instance resuming a moved trajectory, its KV rows fetched and not yet in its engine).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_ARMED = frozenset(p for p in os.environ.get("DORA_CRASH_POINTS", "").split(",") if p)


def crash_point(name: str) -> None:
    """Die here if ``name`` is armed and has not fired yet in this run."""
    if name not in _ARMED:
        return
    marker = Path(os.environ.get("DORA_CRASH_DIR", ".")) / f"crashed.{name}"
    if marker.exists():
        return
    fd = os.open(marker, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, str(os.getpid()).encode())
    os.fsync(fd)
    os.close(fd)
    log.warning("crash point %s: exiting now", name)
    logging.shutdown()
    os._exit(137)
