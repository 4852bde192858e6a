"""What ``dora-rl run`` tells its user before a run (``launcher.ensure_broker``, ``launcher.run_notes``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from dora_rl import launcher, run_progress


@dataclass
class _Broker:
    security: object | None
    bootstrap_servers: str = "127.0.0.1:9092"

    def is_running(self) -> bool:
        return True


@pytest.mark.parametrize("secured", [False, True])
def test_the_embedded_broker_is_said_to_be_single_user_unless_secured(
    secured: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "embedded_broker", lambda: _Broker(object() if secured else None))
    assert launcher.ensure_broker(None) == "127.0.0.1:9092"
    said = capsys.readouterr().err
    assert ("single-user" in said) is not secured
    if not secured:
        assert "anyone who can reach it" in said and "dora-rl broker start --secure" in said


def test_a_run_scored_by_an_outside_service_says_what_it_waits_for() -> None:
    from dora_rl.config import DoraConfig

    external = DoraConfig(mode="dora", reward_service="external")
    assert launcher.waiting_note(external, 5.0, True) is None  # not yet
    assert launcher.waiting_note(external, 40.0, False) is None  # still warming up: version 0 not out
    note = launcher.waiting_note(external, 40.0, True)
    assert note is not None and "scoring the run's trajectories" in note and "--reward external" in note
    assert launcher.waiting_note(DoraConfig(mode="dora"), 400.0, True) is None  # the built-in scorer: no guess


def test_only_a_done_signed_with_the_trainers_key_ends_the_run() -> None:
    """A forged ``done`` (anyone who can write ``dora.metrics``) would end the run and record it FINISHED.
    Every role of the run holds the weight token, so a ``done`` signed with it is passed by too."""
    from dora_rl.infra.kafka.signing import signed
    from dora_rl.schemas.records import Metric

    done = Metric(run_id="r", component="trainer", name="done", value=12.0, ts_ms=0)
    for forged in (done, signed(done, "another run's token"), signed(done, "this run's weight token")):
        progress = run_progress.Progress(steps=12, token="the trainer's key")
        progress.observe(forged)
        assert not progress.done
    progress.observe(signed(done, "the trainer's key"))
    assert progress.done


def test_only_the_trainer_gets_its_key(tmp_path: Path) -> None:
    base = {"DORA_WEIGHT_TOKEN_FILE": str(tmp_path / "weight-token")}
    for role in ("dataset", "scorer", "assembler", "orchestrator", "rollout"):
        assert "DORA_TRAINER_KEY_FILE" not in launcher.role_env(role, base, tmp_path)
    key_file = Path(launcher.role_env("trainer", base, tmp_path)["DORA_TRAINER_KEY_FILE"])
    assert (key_file.stat().st_mode & 0o777) == 0o600 and len(key_file.read_text()) == 32
    assert key_file.read_text() != launcher.weight_token_file(tmp_path).read_text()
    assert launcher.trainer_key_file(tmp_path).read_text() == key_file.read_text()  # created once (a resume)


def test_only_the_scorer_and_the_assembler_get_the_scorers_key(tmp_path: Path) -> None:
    base = {"DORA_WEIGHT_TOKEN_FILE": str(tmp_path / "weight-token")}
    for role in ("dataset", "trainer", "orchestrator", "rollout"):
        assert "DORA_SCORER_KEY_FILE" not in launcher.role_env(role, base, tmp_path)
    files = {Path(launcher.role_env(role, base, tmp_path)["DORA_SCORER_KEY_FILE"]) for role in ("scorer", "assembler")}
    assert len(files) == 1
    key_file = files.pop()
    assert (key_file.stat().st_mode & 0o777) == 0o600 and len(key_file.read_text()) == 32
    assert key_file.read_text() not in (launcher.weight_token_file(tmp_path).read_text(),
                                        launcher.trainer_key_file(tmp_path).read_text())
