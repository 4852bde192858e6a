"""A real S3-compatible server for the tests: S3Proxy, fetched once from Maven Central, run on loopback.

``org.gaul:s3proxy:2.6.0:jar:jar-with-dependencies`` (41 MB, runs on Java 17) serves the S3 API over a
directory (jclouds' ``filesystem`` backend: a bucket is a folder). The first use runs
``mvn dependency:copy`` into ``$DORA_HOME/s3proxy/<version>`` (shared with the Kafka jars); later uses only
check the jar. Clients authenticate with AWS signatures (v2 or v4) as :data:`KEY` / :data:`SECRET`.

S3Proxy 2.6 refuses the ``x-amz-checksum-*`` headers botocore sends by default since 1.36 ("a header you
provided implies functionality that is not implemented"), so :meth:`S3Proxy.client_env` asks botocore to send
checksums only where the operation requires them (real S3, MinIO and Ceph accept both).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

VERSION = "2.6.0"
ARTIFACT = f"org.gaul:s3proxy:{VERSION}:jar:jar-with-dependencies"
PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
KEY, SECRET = "dora-test", "dora-test-secret"


def ensure_s3proxy(cache: Path) -> Path:
    """The S3Proxy jar ``VERSION`` under ``cache`` (fetched on first use)."""
    jar = cache / VERSION / f"s3proxy-{VERSION}-jar-with-dependencies.jar"
    if jar.is_file():
        return jar
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{VERSION}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if jar.is_file():
            return jar
        download = cache / "download"
        shutil.rmtree(download, ignore_errors=True)
        mvn = shutil.which("mvn")
        assert mvn, "mvn is needed once to fetch S3Proxy from Maven Central"
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", f"{PLUGIN}:copy", f"-Dartifact={ARTIFACT}",
               f"-DoutputDirectory={download}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        jars = list(download.glob("*.jar"))
        assert proc.returncode == 0 and jars, f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        jar.parent.mkdir(parents=True, exist_ok=True)
        jars[0].rename(jar.with_suffix(".part"))
        jar.with_suffix(".part").rename(jar)  # whole or absent: a killed fetch leaves no half jar
        shutil.rmtree(download, ignore_errors=True)
    return jar


class S3Proxy:
    """One S3Proxy process on ``host:port`` storing its buckets under ``data`` (created as folders)."""

    def __init__(self, jar: Path, data: Path, port: int, log: Path, buckets: tuple[str, ...] = (),
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        from dora_rl.infra.broker.dist import find_java

        self.endpoint = f"http://{host}:{port}"
        self.data, self._log = data, log
        for bucket in buckets:
            (data / bucket).mkdir(parents=True, exist_ok=True)
        props = log.with_suffix(".properties")
        props.write_text("\n".join([
            "s3proxy.authorization=aws-v2-or-v4", f"s3proxy.endpoint={self.endpoint}",
            f"s3proxy.identity={KEY}", f"s3proxy.credential={SECRET}",
            "jclouds.provider=filesystem", f"jclouds.filesystem.basedir={data}", ""]))
        self.proc = subprocess.Popen([*prefix, find_java(), "-Xmx256m", "-XX:TieredStopAtLevel=1", "-jar", str(jar),
                                      "--properties", str(props)], stdout=log.open("w"), stderr=subprocess.STDOUT)

    def client_env(self) -> dict[str, str]:
        """What a process needs in its environment to use this server through fsspec/s3fs."""
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED"}

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds until the server answers HTTP (AssertionError with its log if it exits or times out)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"S3Proxy exited: {self._log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(self.endpoint, timeout=2)
                return time.monotonic() - t0
            except urllib.error.HTTPError:  # 403 to an unsigned request: it is up
                return time.monotonic() - t0
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"S3Proxy not ready in {timeout}s: {self._log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
