"""``dora-rl dashboard`` in a real browser (headless Chromium from Debian's packages) on a live run.

The checks read the page as rendered, after its script fetched ``api/run`` and drew it (``--dump-dom``
with a virtual-time budget): one timeline row per rollout instance, and a step count that grows
between two reads while the run goes on (the trainer is paused during each read, so neither can meet the
run's end however slow the render). A screenshot of the finished run's page is saved to
``build/dashboard.png`` (to ``docs/dashboard.png`` as well with ``DORA_UPDATE_DOCS=1``: a test run leaves the
source tree as it found it, so a bench run from the same clone is not marked dirty). Chromium comes from
``make setup-browser`` (which ``make test`` runs): in CI
(``CI`` set) a missing browser fails this test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from run_helpers import emulated_run, wait_for

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
CONFIG = emulated_run(steps=10, seed=23, emulated={"base_step_s": 0.05})
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--virtual-time-budget=4000")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    reason = "no Chromium on PATH: `make setup-browser` installs Debian's chromium and chromium-driver"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (required in CI)")
    pytest.skip(reason)


def rendered(browser: str, url: str) -> str:
    """The page's DOM after its script ran (fetched the JSON and drew it)."""
    res = subprocess.run([browser, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def step_count(dom: str) -> int:
    found = re.search(r'id="step-count">(\d+)<', dom)
    assert found, dom[:3000]
    return int(found.group(1))


def timeline_rows(dom: str) -> list[str]:
    rows = [g for g in re.findall(r"<g [^>]*>", dom) if 'class="timeline-row"' in g]
    return [re.search(r'data-instance="([^"]+)"', g).group(1) for g in rows]  # type: ignore[union-attr]


@contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP) for the block, then continued."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def api_steps(url: str) -> int:
    with urllib.request.urlopen(url + "api/run", timeout=10) as resp:
        return int(json.loads(resp.read())["step_count"])


def test_dashboard_renders_a_live_run(bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    browser = chromium()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    dashboard: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: runs.exists() and any((d / "pids.json").exists() for d in runs.iterdir()
                                               if d.name not in known), 120, "the roles")
        run_id = next(d.name for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
        dashboard = subprocess.Popen([sys.executable, "-m", "dora_rl", "dashboard", "--bootstrap-servers", bootstrap,
                                      "--run", run_id, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = dashboard.stdout.readline() if dashboard.stdout else ""
        url = re.search(r"http://\S+/", line)
        assert url, f"the dashboard printed no URL: {line!r}"
        base = url.group(0)
        # The trainer is paused (SIGSTOP) while Chromium renders, so each read sees a run that is still going
        # whatever the machine's load: paused at step >= 1, the first read shows a step count well below the
        # run's 10; after one more step it is paused again for the second read. (Left running, a slow render
        # could meet the run's end: decision 0037.)
        trainer = json.loads((runs / run_id / "pids.json").read_text())["trainer"]
        wait_for(lambda: api_steps(base) >= 1, 180, "a first step on the dashboard")
        with paused(trainer):
            first = rendered(browser, base)
        assert sorted(timeline_rows(first)) == [f"rollout-{i}" for i in range(CONFIG["num_instances"])]
        steps_before = step_count(first)
        assert 1 <= steps_before < CONFIG["steps"] - 2
        wait_for(lambda: api_steps(base) > steps_before, 120, "another step")
        with paused(trainer):
            assert api_steps(base) < CONFIG["steps"], "the run ended before the second read"
            second = rendered(browser, base)
        assert launcher.poll() is None, "read after the run ended"
        assert steps_before < step_count(second) < CONFIG["steps"]
        assert len(timeline_rows(second)) == CONFIG["num_instances"]
        assert 'class="hist-bar"' in second and "chart-reward" in second

        code = launcher.wait(timeout=300)
        assert code == 0, (launcher.stdout.read().decode() if launcher.stdout else "")[-3000:]
        wait_for(lambda: api_steps(base) == CONFIG["steps"], 60, "the finished run on the dashboard")
        shot = tmp_path / "dashboard.png"
        res = subprocess.run([browser, *FLAGS, "--window-size=1000,1100", f"--screenshot={shot}", base],
                             capture_output=True, text=True, timeout=90)
        assert res.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", res.stderr[-2000:]
        (ROOT / "build").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "build" / "dashboard.png")
        if os.environ.get("DORA_UPDATE_DOCS") == "1":
            shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
    finally:
        for p in (dashboard, launcher):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
