"""With no broker where ``--bootstrap-servers`` points, a command a person runs says so in one line, at once
(it printed ~580 lines of client errors and a traceback after 30 s)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on return: nothing listens there


def test_run_and_create_without_a_broker_fail_in_one_line_within_10_s() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    for command in (["run", "--steps", "1"], ["create"], ["audit"]):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "dora_rl", *command, "--bootstrap-servers", address],
                              capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert took < 10, f"{command}: {took:.1f} s"
        assert len(lines) == 1 and "no Kafka broker at" in lines[0] and "dora-rl broker start" in lines[0], lines
