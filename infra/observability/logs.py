"""Structured logs: one line per event, ``ts level logger [pid] message key=value ...``."""

from __future__ import annotations

import logging
import os
import sys


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        msg = record.getMessage()
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:5s} {record.name} [{os.getpid()}] {msg}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once (stderr); noisy client libraries stay at WARNING."""
    root = logging.getLogger()
    if not any(getattr(h, "_dora", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        handler._dora = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "faust", "mode", "urllib3", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
