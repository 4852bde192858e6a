"""Java servers for the tests: one artifact from Maven Central, fetched once into a cache shared by test
sessions, and the process that serves it (:class:`JavaService`).

``fetch_once(artifact, cache, ready, unpack)``: unless ``ready`` exists, run ``mvn dependency:copy`` of
``artifact`` into ``cache/download`` under a file lock (parallel sessions fetch it once), hand the download to
``unpack(download, ...)``, which must leave ``ready`` in place last, and remove the download."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def fetch_once(artifact: str, cache: Path, ready: Path, unpack: Callable[[Path], None]) -> None:
    if ready.exists():
        return
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{artifact.replace(':', '_')}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return
        download = cache / "download"
        shutil.rmtree(download, ignore_errors=True)
        mvn = shutil.which("mvn")
        assert mvn, f"mvn is needed once to fetch {artifact} from Maven Central"
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", f"{PLUGIN}:copy", f"-Dartifact={artifact}",
               f"-DoutputDirectory={download}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0 and any(download.iterdir()), \
            f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        unpack(download)
        shutil.rmtree(download, ignore_errors=True)


class JavaService:
    """A Java server process the tests start (``proc``, logging to ``log``); subclasses say when it answers."""

    name = "service"
    proc: subprocess.Popen[bytes]
    log: Path

    def answers(self) -> bool:
        """One probe: True once the service serves requests (OSError while it does not listen yet)."""
        raise NotImplementedError

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until :meth:`answers` (AssertionError with its log if it exits or times out)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-3000:]}"
            try:
                if self.answers():
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
