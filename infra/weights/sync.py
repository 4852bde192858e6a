"""Policy versions between the trainer and rollout instances: announce on Kafka, move bytes out of band.

``Publisher`` (the trainer) makes a version available and returns its :class:`PolicyVersion`
announcement; ``Fetcher`` (instances) loads an announced version into a model or into fresh tensors.
Both are thin: the weight channel (:mod:`dora_rl.infra.weights`) does the work, with one code path for
every transport ``weight_transport`` names (``ucx``, ``tcp`` or ``file``): buckets with a checksum
each, pulled from the least-loaded holder, refused and re-fetched on corruption. A ``file`` holder
publishes into ``run_dir / "weights"`` (on a shared file system when instances run elsewhere).
Holders bind and announce the addresses of :class:`~dora_rl.infra.endpoints.Endpoints` (from the
process's environment), and UCX uses the interface that holds the announced address.

Invariants: the announcement carries the served manifest as is (``WeightManifest.announce``) and the
fetcher rebuilds it from the announcement (``WeightManifest.from_announcement``), so what a fetcher
verifies is exactly what the publisher packed; at most ``keep`` versions are served at a time (the
oldest is retired when a new one is published).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dora_rl.infra.endpoints import Endpoints
from dora_rl.infra.weights.announcements import sign
from dora_rl.infra.weights.channel import make_weight_client, make_weight_server
from dora_rl.infra.weights.fetcher import FetchStats
from dora_rl.infra.weights.manifest import WeightManifest
from dora_rl.schemas.records import KvTransfer, PolicyVersion


class Publisher:
    """Serves the versions of one run over ``transport`` (``ucx`` | ``tcp`` | ``file``)."""

    def __init__(self, transport: str, run_id: str, run_dir: Path, token: str, keep: int = 3,
                 endpoints: Endpoints | None = None, checksum_algo: str | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.transport = transport
        self.run_id = run_id
        self.dir = run_dir / "weights"
        self.keep = keep
        self._token = token
        self._served: list[int] = []
        ep = endpoints or Endpoints.from_env()
        self._server = make_weight_server(transport, token, ep.bind_host, directory=self.dir,
                                          advertised_host=ep.advertised, checksum_algo=checksum_algo,
                                          **ep.weight_transport_options(transport))

    @property
    def endpoint(self) -> str:
        """Address peers fetch from (``host:port``, or the directory for ``file``)."""
        return str(self._server.address)

    def publish(self, version: int, step: int, state_dict: dict[str, torch.Tensor],
                metrics: dict[str, float] | None = None, checkpoint_uri: str | None = None,
                announced_by: str = PolicyVersion.TRAINER) -> PolicyVersion:
        """Make ``version`` fetchable and return its announcement (not yet sent)."""
        manifest = self._server.serve(version, state_dict)
        self._served.append(version)
        while len(self._served) > self.keep:
            self.retire(self._served.pop(0))
        ann = manifest.announce(self.run_id, step, self.transport, [self.endpoint], metrics=metrics,
                                announced_by=announced_by)
        return sign(ann.replace(checkpoint_uri=checkpoint_uri), self._token)

    def retire(self, version: int) -> None:
        """Stop serving ``version`` and free its memory / files."""
        self._server.retire(version)

    def close(self) -> None:
        """Stop serving everything."""
        self._server.close()


class Fetcher:
    """Loads announced versions (instance side)."""

    def __init__(self, transport: str, token: str, endpoints: Endpoints | None = None) -> None:
        self.transport = transport
        ep = endpoints or Endpoints.from_env()
        self._client = make_weight_client(transport, token, **ep.weight_transport_options(transport))

    def fetch_into(self, ann: PolicyVersion, model: torch.nn.Module,
                   extra_holders: list[str] | None = None) -> FetchStats:
        """Fetch version ``ann.version`` straight into ``model``'s parameters (in place)."""
        manifest = WeightManifest.from_announcement(ann)
        names = {t.name for t in manifest.tensors}
        target = {k: v for k, v in model.state_dict().items() if k in names}  # tied weights appear once
        stats: list[FetchStats] = []
        self._client.fetch(manifest, [*ann.holders, *(extra_holders or [])], into=target, on_stats=stats.append)
        return stats[0]

    def fetch_state(self, ann: PolicyVersion) -> tuple[dict[str, torch.Tensor], FetchStats]:
        """Fetch version ``ann.version`` into fresh tensors (for engines that load a state dict)."""
        stats: list[FetchStats] = []
        state = self._client.fetch(WeightManifest.from_announcement(ann), list(ann.holders), on_stats=stats.append)
        return state, stats[0]

    def fetch_transfer(self, kv: KvTransfer) -> dict[str, torch.Tensor]:
        """Fetch the tensors ``kv`` names (a migrating trajectory's KV rows) from its holder alone, each bucket
        checked against the record's checksums; raises like any fetch."""
        manifest = WeightManifest(kv.transfer, tuple(kv.tensors), tuple(kv.buckets), kv.total_bytes,
                                  kv.checksum_algo)
        manifest.validate()
        return self._client.fetch(manifest, [kv.holder], probe_load=False)

    def close(self) -> None:
        """Release the client."""
        self._client.close()


__all__ = ["FetchStats", "Fetcher", "Publisher"]
