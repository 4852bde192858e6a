"""What the launcher tells a user under a run's first line (issue 34: an emulated run scores 0 and said nothing)."""

from __future__ import annotations

from dora_rl.config import DoraConfig
from dora_rl.launcher import run_notes


def test_an_emulated_run_says_its_rewards_are_zero_by_construction() -> None:
    notes = run_notes(DoraConfig.from_dict({"engine": "emulated"}))
    assert len(notes) == 1 and "every reward is 0" in notes[0]
    assert run_notes(DoraConfig.from_dict({"engine": "torch"})) == []
