"""``LocalCluster``: *nodes* :class:`~dora_rl.infra.broker.server.LocalBroker` nodes on loopback as one KRaft cluster
(combined broker+controller, static quorum). It backs the fault-tolerance tests and ``bench/chaos.py``; it drives
each node's start in phases (prepare all, launch all, then wait), which is why it reaches into ``LocalBroker``'s
start steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from dora_rl.infra.broker.dist import DEFAULT_KAFKA_VERSION, dora_home, free_port, new_cluster_id, wait_for_brokers
from dora_rl.infra.broker.security import BrokerSecurity, SecurityAdmin
from dora_rl.infra.broker.server import _ISR_KEYS, _RF_KEYS, BrokerError, LocalBroker
from dora_rl.infra.kafka.security import ClientSecurity

__all__ = ["LocalCluster"]


class LocalCluster:
    """*nodes* combined broker+controller nodes on loopback: RF 3, ``min.insync.replicas`` 2, static quorum.

    All nodes share one cluster id; each has its own dir ``<data_dir>/node<N>`` and free ports, recorded
    in ``<data_dir>/cluster.json`` so a cluster restarted on the same dir keeps them. With *security* all
    nodes share one TLS material and admin (``<data_dir>/security`` unless its ``directory`` is set).
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        nodes: int = 3,
        version: str = DEFAULT_KAFKA_VERSION,
        heap: str = "512m",
        config: Mapping[str, object] | None = None,
        cache_dir: Path | str | None = None,
        security: BrokerSecurity | None = None,
    ) -> None:
        self.data_dir = Path(data_dir or dora_home() / "cluster").expanduser().resolve()
        self.size, self.version, self.heap, self.cache_dir = nodes, version, heap, cache_dir
        if security is not None and security.directory is None:
            security = dataclasses.replace(security, directory=self.data_dir / "security")
        self.security = security
        rf, isr = min(3, nodes), (2 if nodes >= 3 else 1)
        self.config: dict[str, object] = {**dict.fromkeys(_RF_KEYS, rf), **dict.fromkeys(_ISR_KEYS, isr)}
        self.config.update({"unclean.leader.election.enable": "false", "num.io.threads": 2, **(config or {})})
        self.nodes: list[LocalBroker] = []

    @property
    def bootstrap_servers(self) -> str:
        if not self.nodes:
            raise BrokerError("cluster not started")
        return ",".join(n.bootstrap_servers for n in self.nodes)

    def _build_nodes(self) -> None:
        state_file = self.data_dir / "cluster.json"
        try:
            st = json.loads(state_file.read_text())
            ports: list[list[int]] = st["ports"]
            cid: str = st["cluster_id"]
        except (OSError, ValueError, KeyError):
            ports, cid = [[free_port(), free_port()] for _ in range(self.size)], new_cluster_id()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            state_file.write_text(json.dumps({"ports": ports, "cluster_id": cid, "version": self.version}))
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        node = functools.partial(LocalBroker, version=self.version, heap=self.heap, config=self.config)
        node = functools.partial(node, quorum_voters=voters, cluster_id=cid, cache_dir=self.cache_dir,
                                 security=self.security)
        self.nodes = [
            node(self.data_dir / f"node{i + 1}", port=p, controller_port=c, node_id=i + 1)
            for i, (p, c) in enumerate(ports)
        ]

    def client_security(self) -> ClientSecurity:
        """What a client needs to reach this cluster as its admin (super user); PLAINTEXT if unsecured."""
        if not self.nodes:
            raise BrokerError("cluster not started")
        return self.nodes[0].client_security()

    def admin(self, timeout: float = 30.0) -> SecurityAdmin:
        """An admin of this (secured, running) cluster's SCRAM users and ACLs."""
        return SecurityAdmin(self.bootstrap_servers, self.client_security(), timeout)

    def _wait_all(self, deadline: float) -> None:
        try:
            wait_for_brokers(self.bootstrap_servers, self.size, deadline, security=self.client_security())
        except TimeoutError as exc:
            tails = "\n".join(f"--- node {n.node_id}:\n{n.log_tail(15)}" for n in self.nodes)
            raise BrokerError(f"{exc}\n{tails}") from exc

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Format (first time only), start all nodes, wait until metadata lists every broker."""
        deadline = time.monotonic() + timeout
        self._build_nodes()
        try:
            for node in self.nodes:
                node._prepare()
            for node in self.nodes:
                node._launch()
            for node in self.nodes:
                node._wait_port(deadline)  # a node opens its port only once the quorum has a leader
            self._wait_all(deadline)
        except BaseException:
            self.stop(timeout=5.0)
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM all nodes at once (the quorum stays up while they shut down), SIGKILL stragglers."""
        for node in self.nodes:
            if node._pid is not None and node.is_running():
                os.kill(node._pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop(timeout)

    def kill_node(self, i: int) -> None:
        """SIGKILL node *i* (0-based index into :attr:`nodes`)."""
        self.nodes[i].kill()

    def restart_node(self, i: int, timeout: float = 90.0) -> None:
        """Start node *i* again on its data dir; wait until it serves metadata listing every broker."""
        deadline = time.monotonic() + timeout
        node = self.nodes[i]
        node.stop(timeout=10.0)
        node._launch()
        node._wait_port(deadline)
        try:  # ask the restarted node itself: the others may still list its previous incarnation
            wait_for_brokers(node.bootstrap_servers, self.size, deadline, security=node.client_security())
        except TimeoutError as exc:
            raise BrokerError(f"{exc}; last lines of {node.log_file}:\n{node.log_tail()}") from exc

    def node_index(self, node_id: int) -> int:
        """0-based index of the node whose Kafka ``node.id`` is *node_id*."""
        return next(i for i, n in enumerate(self.nodes) if n.node_id == node_id)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
