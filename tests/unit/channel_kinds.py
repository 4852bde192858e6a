"""The weight-channel transports the channel tests run over (tests/unit is on sys.path)."""

from __future__ import annotations

import pytest

TOKEN = "run-secret"


def _ucx_available() -> bool:
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception:
        return False
    return True


NEEDS_UCX = pytest.mark.skipif(not _ucx_available(), reason="ucxx missing")
# "ucx": defaults (same host -> cross-memory attach); "ucx-net": the network (tcp) profile forced
KINDS = ["tcp", pytest.param("ucx", marks=NEEDS_UCX), pytest.param("ucx-net", marks=NEEDS_UCX)]


def transport_options(kind: str) -> tuple[str, dict[str, object]]:
    """``(transport kind, constructor options)`` of a test kind."""
    if kind == "ucx-net":
        from dora_rl.infra.weights.ucx import UcxOptions

        return "ucx", {"options": UcxOptions(same_host_tls=None)}
    return kind, {}
