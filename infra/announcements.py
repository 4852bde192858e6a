"""What a reader of ``dora.policy.versions`` checks before it acts on an announcement (torch-free unless
the manifest is checked, so an emulated instance starts without torch: docs/decisions/0039)."""

from __future__ import annotations

from dora_rl.schemas.records import PolicyVersion


def announcement_problem(ann: PolicyVersion, check_manifest: bool) -> str | None:
    """Why ``ann`` cannot be loaded from, or None: a negative version, no holder (every transport announces
    at least one: an address, or a directory for ``file``), or (``check_manifest``) a manifest that breaks
    its invariants. Readers dead-letter such a record and go on: it used to kill every rollout instance, on
    every restart, since the record stays on the topic."""
    if int(ann.version) < 0:
        return f"announcement of version {ann.version}: versions start at 0"
    if not ann.holders:
        return f"announcement of version {ann.version} names no holder"
    if check_manifest:
        from dora_rl.infra.weights.manifest import WeightManifest  # torch: only where weights are loaded

        try:
            WeightManifest.from_announcement(ann)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return f"announcement of version {ann.version}: invalid manifest: {exc}"
    return None
