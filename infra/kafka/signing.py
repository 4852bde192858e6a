"""Signatures of records that let a reader act on someone else's word: HMAC-SHA256 (hex) of the record's Avro
encoding with its ``signature`` field null, keyed by the run's weight-channel token (decision 0054). The token
is never on a topic. Every trainer, instance and processor of the run has it, so a record signed with it
comes from a party of the run. A reader without a token cannot check, and does not."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Protocol, TypeVar


class Signable(Protocol):
    @property
    def signature(self) -> str | None: ...

    def replace(self, **changes: Any) -> Any: ...

    def encode(self) -> tuple[bytes, list[tuple[str, bytes]]]: ...

    def unsigned_encoding(self) -> bytes: ...


S = TypeVar("S", bound=Signable)


def mac(record: Signable, token: str) -> str:
    """The signature ``record`` has when signed with ``token``."""
    return hmac.new(token.encode(), record.unsigned_encoding(), hashlib.sha256).hexdigest()


def signed(record: S, token: str) -> S:
    """``record`` signed with ``token`` (unchanged when ``token`` is empty: nothing to sign with)."""
    return record.replace(signature=mac(record, token)) if token else record


def signature_problem(record: Signable, token: str, what: str) -> str | None:
    """Why ``record`` (named ``what`` in the reason) is not proven to come from a party of the run, or None
    (always None without a token)."""
    if not token:
        return None
    if not record.signature:
        return f"{what} is not signed with the run's token"
    if not hmac.compare_digest(record.signature, mac(record, token)):
        return f"{what} has a wrong signature (not signed with the run's token)"
    return None
