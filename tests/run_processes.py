"""The run processes a test left alive (``tests/conftest.py`` reaps them after each test)."""

from __future__ import annotations

import os
from pathlib import Path


def leftover_run_processes(under: Path) -> list[int]:
    """Pids of ``dora-rl`` processes (launchers, roles) whose ``DORA_HOME`` lies under ``under``: those a test
    started. Matched on the command line (``python -m dora_rl`` or the ``dora-rl`` script), never a broker's JVM."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in (os.getpid(), os.getppid()):
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not ((b"-m" in argv and b"dora_rl" in argv) or any(a.endswith(b"/dora-rl") for a in argv[:2])):
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or a zombie
            continue
        home = next((e.removeprefix(b"DORA_HOME=") for e in env if e.startswith(b"DORA_HOME=")), b"")
        if home and Path(os.fsdecode(home)).is_relative_to(under):
            found.append(int(proc.name))
    return found
