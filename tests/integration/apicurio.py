"""A real Apicurio Registry for the tests: fetched once from Maven Central, run in memory on loopback.

``io.apicurio:apicurio-registry-app:2.6.13.Final:tar.gz:all`` is the Quarkus app (a ``-runner.jar`` and
its ``lib/``, ~140 MB); 3.x needs Java 21, this machine has 17 (docs/decisions/0022). The first use
runs ``mvn dependency:copy`` and unpacks it under ``$DORA_HOME/apicurio/<version>`` (the real
``DORA_HOME``, shared with the Kafka jars); later uses only check a marker file. The registry stores
schemas in an in-memory H2 database and serves the Confluent-compatible API at ``/apis/ccompat/v7``.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

from java_service import JavaService, fetch_once

VERSION = "2.6.13.Final"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{VERSION}:tar.gz:all"


def ensure_apicurio(cache: Path) -> Path:
    """The runner jar of Apicurio ``VERSION`` under ``cache`` (fetched and unpacked on first use)."""
    home = cache / VERSION
    jar = home / f"apicurio-registry-app-{VERSION}-runner.jar"
    marker = home / ".complete"

    def unpack(download: Path) -> None:
        shutil.rmtree(home, ignore_errors=True)
        with tarfile.open(next(download.glob("*.tar.gz"))) as tar:
            tar.extractall(home, filter="data")
        assert jar.is_file(), f"no {jar.name} in {ARTIFACT}"
        marker.write_text(f"{ARTIFACT}\n")

    fetch_once(ARTIFACT, cache, marker, unpack)
    return jar


class Apicurio(JavaService):
    """One in-memory registry process on 127.0.0.1:<port>; :attr:`ccompat` is its Confluent API URL."""

    def __init__(self, jar: Path, port: int, log: Path) -> None:
        from dora_rl.infra.broker.dist import find_java

        self.url = f"http://127.0.0.1:{port}"
        self.ccompat = f"{self.url}/apis/ccompat/v7"
        self.name, self.log = "Apicurio", log
        self.proc = subprocess.Popen([find_java(), "-Xmx256m", "-XX:TieredStopAtLevel=1",
                                      "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={port}", "-jar", str(jar)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=jar.parent)

    def answers(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/apis/registry/v2/system/info", timeout=2) as resp:
            return bool(resp.status == 200)
