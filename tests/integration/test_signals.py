"""A run ends only when someone ends it, and nothing outlives it: a signalled launcher leaves no role behind,
even when its output pipe is gone first (Ctrl-C on ``dora-rl run ... | tee log``, an ssh drop): every role
of the run is gone within 10 s of the launcher; and a new run never overwrites a recorded one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import emulated_run, steps_done, wait_for

pytestmark = pytest.mark.broker


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited and awaits its reaping)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_signalled_launcher_with_its_output_gone_leaves_no_role(bootstrap: str, dora_home: Path, tmp_path: Path,
                                                                   sig: signal.Signals) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(emulated_run(steps=60, seed=int(sig))))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    try:
        wait_for(lambda: runs.exists() and any((d / "pids.json").exists() for d in runs.iterdir()
                                               if d.name not in known), 120, "the roles")
        rdir = next(d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
        wait_for(lambda: steps_done(bootstrap, rdir.name) >= 1, 180, "a first step")
        pids = set(json.loads((rdir / "pids.json").read_text()).values())
        assert sum(_alive(p) for p in pids) >= 4  # the dataset role may have finished already
        assert launcher.stdout is not None
        launcher.stdout.close()  # the reader of its output exits first: every later write hits a dead pipe
        time.sleep(1.0)
        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        pids |= set(json.loads((rdir / "pids.json").read_text()).values())  # restarted roles too
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p for p in pids if _alive(p))
        assert not left, f"roles still running 10 s after the launcher: {left}"
    finally:
        if launcher.poll() is None:  # a failure before the signal: stop the run as a user would
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()


def test_an_existing_run_id_is_refused_not_overwritten(bootstrap: str) -> None:
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka.runs import RunExists, get_run, start_run

    config = DoraConfig.from_dict(emulated_run(steps=2))
    first = start_run(bootstrap, config, run_id="run-id-taken")
    with pytest.raises(RunExists, match="dora-rl resume run-id-taken"):
        start_run(bootstrap, DoraConfig.from_dict(emulated_run(steps=5)), run_id="run-id-taken")
    assert get_run(bootstrap, "run-id-taken").config_json == first.config_json  # the record is unchanged


def test_a_rewritten_run_record_does_not_change_the_run_for_a_role_holding_its_token(bootstrap: str) -> None:
    """Decision 0060: a record of the run written after it, unsigned or signed with another run's token (another
    ``reward_fn``, a FINISHED state), is passed by whoever holds the run's token; its own signed records count."""
    import dataclasses

    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka.runs import finish_run, get_run, list_runs, publish, start_run
    from dora_rl.infra.kafka.signing import signed

    config = DoraConfig.from_dict(emulated_run(steps=2))
    genuine = start_run(bootstrap, config, run_id="run-signed", token="the run's token")
    evil = dataclasses.replace(config, reward_fn="os:system").to_json()
    for key in ("", "another run's token"):
        publish(bootstrap, signed(genuine.replace(config_json=evil, state="FINISHED", signature=None), key), key)
    assert get_run(bootstrap, "run-signed").config_json == evil  # an operator's read without the token
    mine = get_run(bootstrap, "run-signed", "the run's token")
    assert (mine.config_json, mine.state, mine.start_offsets) == (genuine.config_json, "STARTED",
                                                                  genuine.start_offsets)
    assert list(list_runs(bootstrap, "the run's token")) == ["run-signed"]  # no other run's record verifies
    finish_run(bootstrap, mine, "{}", token="the run's token")
    assert get_run(bootstrap, "run-signed", "the run's token").state == "FINISHED"
