"""Policy versions between the trainer and rollout instances: announce on Kafka, move bytes out of band.

``Publisher`` (trainer, and any instance that re-serves what it holds) makes a version
available and returns the :class:`PolicyVersion` announcement; ``Fetcher`` (instances) loads an
announced version into a model. Transports, chosen explicitly by ``weight_transport``:

- ``ucx`` / ``tcp``: the weight channel of :mod:`dora_rl.infra.weights` — buckets with a checksum
  each, pulled from the least-loaded holder, refused and re-fetched on corruption;
- ``file``: one safetensors file per version on a shared file system (single machine or NFS),
  with a SHA-256 checksum in the announcement.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dora_rl.schemas.records import BucketEntry, PolicyVersion, TensorEntry

from .kafka_io import now_ms

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchStats:
    """Figures of one version switch on an instance."""

    version: int
    bytes: int
    seconds: float
    holder: str

    @property
    def gbps(self) -> float:
        """Gigabytes per second (1e9 bytes)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class Publisher:
    """Serves versions of one run (``transport`` in ucx | tcp | file)."""

    def __init__(self, transport: str, run_id: str, run_dir: Path, token: str, keep: int = 3) -> None:
        self.transport = transport
        self.run_id = run_id
        self.dir = run_dir / "weights"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._served: list[int] = []
        self._server: Any = None
        if transport in ("ucx", "tcp"):
            from .weights.channel import make_weight_server

            self._server = make_weight_server(transport, token)
        elif transport != "file":
            raise ValueError(f"unknown weight transport {transport!r} (ucx, tcp or file)")

    @property
    def endpoint(self) -> str:
        """Address peers fetch from ('' for file)."""
        return str(self._server.address) if self._server is not None else ""

    def publish(self, version: int, step: int, state_dict: dict[str, torch.Tensor],
                metrics: dict[str, float] | None = None) -> PolicyVersion:
        """Make ``version`` fetchable and return its announcement (not yet sent)."""
        if self._server is not None:
            manifest = self._server.serve(version, state_dict)
            ann = announcement_from_manifest(self.run_id, version, step, self.transport, [self.endpoint],
                                             manifest.to_dict(), metrics or {})
        else:
            from safetensors.torch import save_file

            path = self.dir / f"v{version:06d}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(tmp))
            tmp.rename(path)
            size = path.stat().st_size
            ann = PolicyVersion(run_id=self.run_id, version=version, step=step, created_ms=now_ms(),
                                transport="file", holders=(str(path),), total_bytes=size,
                                checksum_algo="sha256", tensors=(),
                                buckets=(BucketEntry(index=0, nbytes=size, checksum=_sha256(path)),),
                                checkpoint_uri=None, train_metrics=dict(metrics or {}))
        self._served.append(version)
        while len(self._served) > self.keep:
            self.retire(self._served.pop(0))
        return ann

    def retire(self, version: int) -> None:
        """Stop serving ``version`` and free its memory / file."""
        if self._server is not None:
            self._server.retire(version)
        else:
            (self.dir / f"v{version:06d}.safetensors").unlink(missing_ok=True)

    def close(self) -> None:
        """Stop serving everything."""
        if self._server is not None:
            self._server.close()


def announcement_from_manifest(run_id: str, version: int, step: int, transport: str, holders: list[str],
                               manifest: dict[str, Any], metrics: dict[str, float]) -> PolicyVersion:
    """Map a channel manifest (``WeightManifest.to_dict()``) to the Avro announcement."""
    return PolicyVersion(
        run_id=run_id, version=version, step=step, created_ms=now_ms(), transport=transport,
        holders=tuple(holders), total_bytes=int(manifest["total_bytes"]),
        checksum_algo=str(manifest["checksum_algo"]),
        tensors=tuple(TensorEntry(name=t["name"], dtype=t["dtype"], shape=tuple(int(s) for s in t["shape"]),
                                  bucket=int(t["bucket"]), offset=int(t["offset"]), nbytes=int(t["nbytes"]))
                      for t in manifest["tensors"]),
        buckets=tuple(BucketEntry(index=int(b["index"]), nbytes=int(b["nbytes"]), checksum=str(b["checksum"]))
                      for b in manifest["buckets"]),
        checkpoint_uri=None, train_metrics=dict(metrics))


def manifest_from_announcement(ann: PolicyVersion) -> dict[str, Any]:
    """Inverse of :func:`announcement_from_manifest` (the dict ``WeightManifest.from_dict`` takes)."""
    return {"version": int(ann.version), "total_bytes": int(ann.total_bytes), "checksum_algo": ann.checksum_algo,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bucket": t.bucket,
                         "offset": t.offset, "nbytes": t.nbytes} for t in ann.tensors],
            "buckets": [{"index": b.index, "nbytes": b.nbytes, "checksum": b.checksum} for b in ann.buckets]}


class Fetcher:
    """Loads announced versions into a model (instance side)."""

    def __init__(self, transport: str, token: str) -> None:
        self.transport = transport
        self._client: Any = None
        if transport in ("ucx", "tcp"):
            from .weights.channel import make_weight_client

            self._client = make_weight_client(transport, token)
        elif transport != "file":
            raise ValueError(f"unknown weight transport {transport!r} (ucx, tcp or file)")

    def fetch_into(self, ann: PolicyVersion, model: torch.nn.Module,
                   extra_holders: list[str] | None = None) -> FetchStats:
        """Fetch version ``ann.version`` and write it into ``model``'s parameters."""
        from dora_rl.modeling import load_weights

        t0 = time.perf_counter()
        if self._client is not None:
            from .weights.manifest import WeightManifest

            manifest = WeightManifest.from_dict(manifest_from_announcement(ann))
            holders = list(ann.holders) + list(extra_holders or [])
            names = {t.name for t in ann.tensors}
            target = {k: v for k, v in model.state_dict().items() if k in names}  # tied weights appear once
            state = self._client.fetch(manifest, holders, into=target)
            if state is not target:
                load_weights(model, state)
            holder = holders[0]
        else:
            from safetensors.torch import load_file

            path = Path(ann.holders[0])
            digest = _sha256(path)
            if ann.buckets and digest != ann.buckets[0].checksum:
                raise ValueError(f"version {ann.version}: checksum mismatch for {path}")
            load_weights(model, load_file(str(path)))
            holder = str(path)
        return FetchStats(int(ann.version), int(ann.total_bytes), time.perf_counter() - t0, holder)

    def fetch_state(self, ann: PolicyVersion) -> tuple[dict[str, torch.Tensor], FetchStats]:
        """Fetch version ``ann.version`` into fresh tensors (for engines that load a state dict)."""
        t0 = time.perf_counter()
        if self._client is not None:
            from .weights.manifest import WeightManifest

            state = self._client.fetch(WeightManifest.from_dict(manifest_from_announcement(ann)), list(ann.holders))
        else:
            from safetensors.torch import load_file

            path = Path(ann.holders[0])
            if ann.buckets and _sha256(path) != ann.buckets[0].checksum:
                raise ValueError(f"version {ann.version}: checksum mismatch for {path}")
            state = load_file(str(path))
        return state, FetchStats(int(ann.version), int(ann.total_bytes), time.perf_counter() - t0, ann.holders[0])

    def close(self) -> None:
        """Release the client."""
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
