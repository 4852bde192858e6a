"""A real Apicurio Registry for the tests: fetched once from Maven Central, run in memory on loopback.

``io.apicurio:apicurio-registry-app:2.6.13.Final:tar.gz:all`` is the Quarkus app (a ``-runner.jar`` and
its ``lib/``, ~140 MB); 3.x needs Java 21, this machine has 17 (docs/decisions/0022). The first use
runs ``mvn dependency:copy`` and unpacks it under ``$DORA_HOME/apicurio/<version>`` (the real
``DORA_HOME``, shared with the Kafka jars); later uses only check a marker file. The registry stores
schemas in an in-memory H2 database and serves the Confluent-compatible API at ``/apis/ccompat/v7``.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

VERSION = "2.6.13.Final"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{VERSION}:tar.gz:all"
PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def ensure_apicurio(cache: Path) -> Path:
    """The runner jar of Apicurio ``VERSION`` under ``cache`` (fetched and unpacked on first use)."""
    home = cache / VERSION
    jar = home / f"apicurio-registry-app-{VERSION}-runner.jar"
    marker = home / ".complete"
    if marker.is_file():
        return jar
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{VERSION}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return jar
        download = cache / "download"
        shutil.rmtree(download, ignore_errors=True)
        mvn = shutil.which("mvn")
        assert mvn, "mvn is needed once to fetch Apicurio Registry from Maven Central"
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", f"{PLUGIN}:copy", f"-Dartifact={ARTIFACT}",
               f"-DoutputDirectory={download}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        archives = list(download.glob("*.tar.gz"))
        assert proc.returncode == 0 and archives, f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        shutil.rmtree(home, ignore_errors=True)
        with tarfile.open(archives[0]) as tar:
            tar.extractall(home, filter="data")
        shutil.rmtree(download, ignore_errors=True)
        assert jar.is_file(), f"no {jar.name} in {ARTIFACT}"
        marker.write_text(f"{ARTIFACT}\n")
    return jar


class Apicurio:
    """One in-memory registry process on 127.0.0.1:<port>; :attr:`ccompat` is its Confluent API URL."""

    def __init__(self, jar: Path, port: int, log: Path) -> None:
        from dora_rl.infra.broker.dist import find_java

        self.url = f"http://127.0.0.1:{port}"
        self.ccompat = f"{self.url}/apis/ccompat/v7"
        self._log = log
        self.proc = subprocess.Popen([find_java(), "-Xmx256m", "-XX:TieredStopAtLevel=1",
                                      "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={port}", "-jar", str(jar)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=jar.parent)

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until the registry answers (AssertionError with its log if it exits or times out)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"Apicurio exited: {self._log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/apis/registry/v2/system/info", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"Apicurio not ready in {timeout}s: {self._log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
