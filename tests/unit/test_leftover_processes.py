"""The suite's reaper (``tests/conftest.py``) finds the run processes a test left alive: those with a
``dora_rl`` command line and a ``DORA_HOME`` under the session's temporary folder, nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from run_processes import leftover_run_processes


def test_only_dora_processes_of_this_sessions_homes_are_found(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours, elsewhere = ({**os.environ, "DORA_HOME": home} for home in (str(tmp_path / "home"), "/elsewhere"))
    procs = {"role": subprocess.Popen([*sleeper, "-m", "dora_rl"], env=ours),
             "another home": subprocess.Popen([*sleeper, "-m", "dora_rl"], env=elsewhere),
             "not dora": subprocess.Popen([*sleeper, "dora_rl"], env=ours)}
    try:
        time.sleep(0.3)  # exec'd: the command line and environment are the sleeper's
        found = leftover_run_processes(tmp_path)
        assert procs["role"].pid in found, found
        assert procs["another home"].pid not in found and procs["not dora"].pid not in found, found
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert leftover_run_processes(tmp_path) == []
