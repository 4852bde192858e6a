"""What a reader of ``dora.policy.versions`` checks before it acts on an announcement (torch-free unless
the manifest is checked, so an emulated instance starts without torch: docs/decisions/0039), and the
signature that proves an announcement came from a party of the run (docs/decisions/0054).

Signature: ``HMAC-SHA256(token, encode(ann with signature = None))`` in hex, ``token`` the run's weight-channel
token. Whoever serves weights (the trainer, a holder) signs what it announces; a reader holding the token
refuses an announcement that is unsigned or signed with another key. A reader without a token cannot check and
does not (it could not fetch the weights either).
"""

from __future__ import annotations

from dora_rl.infra.kafka.signing import signature_problem, signed
from dora_rl.schemas.records import PolicyVersion


def sign(ann: PolicyVersion, token: str) -> PolicyVersion:
    """``ann`` signed with ``token`` (unchanged when ``token`` is empty: nothing to sign with)."""
    return signed(ann, token)


def announcement_problem(ann: PolicyVersion, check_manifest: bool, token: str = "") -> str | None:
    """Why ``ann`` cannot be loaded from, or None: a negative version, no holder (every transport announces
    at least one: an address, or a directory for ``file``), no valid signature (``token`` given), or
    (``check_manifest``) a manifest that breaks
    its invariants. Readers dead-letter such a record and go on: it used to kill every rollout instance, on
    every restart, since the record stays on the topic."""
    if int(ann.version) < 0:
        return f"announcement of version {ann.version}: versions start at 0"
    if not ann.holders:
        return f"announcement of version {ann.version} names no holder"
    unsigned = signature_problem(ann, token, f"announcement of version {ann.version}")
    if unsigned is not None:
        return unsigned
    if check_manifest:
        from dora_rl.infra.weights.manifest import WeightManifest  # torch: only where weights are loaded

        try:
            WeightManifest.from_announcement(ann)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return f"announcement of version {ann.version}: invalid manifest: {exc}"
    return None


def kind_problem(ann: PolicyVersion, expected: str) -> str | None:
    """Why ``ann`` is not of the kind its topic carries (``expected``: :attr:`PolicyVersion.TRAINER` on
    ``dora.policy.versions``, :attr:`PolicyVersion.HOLDER` on ``dora.policy.holders``), or None. One kind per
    topic lets the broker's ACLs say who may announce a version (decision 0057)."""
    if ann.announced_by != expected:
        return f"an announcement by {ann.announced_by!r} where only {expected!r} announcements belong"
    return None
