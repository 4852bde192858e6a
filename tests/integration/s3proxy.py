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

import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from java_service import JavaService, fetch_once

VERSION = "2.6.0"
ARTIFACT = f"org.gaul:s3proxy:{VERSION}:jar:jar-with-dependencies"
KEY, SECRET = "dora-test", "dora-test-secret"


def ensure_s3proxy(cache: Path) -> Path:
    """The S3Proxy jar ``VERSION`` under ``cache`` (fetched on first use)."""
    jar = cache / VERSION / f"s3proxy-{VERSION}-jar-with-dependencies.jar"

    def place(download: Path) -> None:
        jar.parent.mkdir(parents=True, exist_ok=True)
        next(download.glob("*.jar")).rename(jar.with_suffix(".part"))
        jar.with_suffix(".part").rename(jar)  # whole or absent: a killed fetch leaves no half jar

    fetch_once(ARTIFACT, cache, jar, place)
    return jar


class S3Proxy(JavaService):
    """One S3Proxy process on ``host:port`` storing its buckets under ``data`` (created as folders)."""

    def __init__(self, jar: Path, data: Path, port: int, log: Path, buckets: tuple[str, ...] = (),
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        from dora_rl.infra.broker.dist import find_java

        self.name, self.endpoint = "S3Proxy", f"http://{host}:{port}"
        self.data, self.log = data, log
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

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=2)
        except urllib.error.HTTPError:  # 403 to an unsigned request: it is up
            pass
        return True
