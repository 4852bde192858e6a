"""Broker-side Kafka security for the project's own broker/cluster: TLS material, listeners, SCRAM users, ACLs.

:class:`BrokerSecurity` says what to secure (the host names/IPs the certificate must cover, the admin and
controller user names); :meth:`BrokerSecurity.materialize` creates, once, in a 0700 directory:

- ``ca.pem`` (public) / ``ca.key`` (0600): a private CA made with the ``openssl`` CLI (EC P-256);
- ``broker.pem`` (0600): the broker's unencrypted PKCS#8 key, its certificate (SAN: every host given
  plus ``localhost``; renewed when the host set changes) and the CA, read by Kafka as ``ssl.keystore.type=PEM``;
- ``admin.password``, ``controller.password`` (0600): generated passwords.

Listeners (:meth:`BrokerSecrets.server_properties`): clients and brokers talk ``SASL_SSL`` with
SCRAM-SHA-512 (inter-broker as the admin user); the KRaft controller listener is ``SASL_SSL`` with PLAIN
(SCRAM credentials live in the metadata log the controllers serve, so they cannot authenticate the
controllers themselves) with a generated controller password. The ``StandardAuthorizer`` denies whatever
no ACL allows; the admin and controller principals are super users. The admin SCRAM credential is
written into the metadata at ``kafka-storage format`` time (:meth:`BrokerSecrets.format_args`).

:class:`SecurityAdmin` creates SCRAM users and grants a DORA role its ACLs (:func:`role_grants`).
Invariants: no password is ever put in argv, a log line or an exception message; grants are derived
from the topic catalogue (writes per topic, exactly the topics a role is declared to write).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.security import ClientSecurity, client_config, write_client_config, write_private

__all__ = [
    "ROLES",
    "BrokerSecrets",
    "BrokerSecurity",
    "BrokerSecurityError",
    "Grant",
    "SecurityAdmin",
    "role_grants",
]

ResourceKind = Literal["TOPIC", "GROUP", "TRANSACTIONAL_ID", "CLUSTER"]
Pattern = Literal["LITERAL", "PREFIXED"]

MECHANISM = "SCRAM-SHA-512"
CLIENT_LISTENER = "SASL_SSL"
TOPIC_PREFIX = "dora."
GROUP_PREFIX = "dora"
"""Consumer groups: ``dora.<run>.<component>`` and the readers' ``dora-reader-*``, ``dora-offsets``, …"""
TRANSACTIONAL_PREFIX = "dora."
"""Transactional ids are ``dora.<run>.<role>`` (streams/kafka_runtime.py, dataset, trainer)."""
TRANSACTIONAL_ROLES = frozenset({"dataset", "orchestrator", "scorer", "assembler", "trainer"})
OPERATOR_TOOLS = ("monitor", "dashboard", "audit", "replay", "runs", "bench")
ROLES: tuple[str, ...] = (*topics.ROLE_NAMES, "launcher", "operator")
"""What :meth:`SecurityAdmin.grant_role` accepts: every role of a run, ``launcher`` (``dora-rl run``/
``resume``: records runs, creates topics) and ``operator`` (monitor, audit, replay, runs, bench)."""


class BrokerSecurityError(RuntimeError):
    """TLS material could not be made, or a user/ACL could not be created."""


@dataclass(frozen=True)
class Grant:
    """One ALLOW ACL, principal aside: *operation* on the resources *pattern* matches."""

    resource: ResourceKind
    name: str
    pattern: Pattern
    operation: str


def role_grants(role: str, run_id: str | None = None) -> tuple[Grant, ...]:
    """The ACLs a DORA *role* needs (see :data:`ROLES`), derived from the topic catalogue.

    With *run_id*: for that run and role only (decision 0063). Its topics, consumer groups and transactional
    ids all live under ``dora.<run_id>.`` (:func:`topics.in_run`), so the principal reads only its run's topics
    (READ, PREFIXED ``dora.<run_id>.``) and the run registry ``dora.runs``; it writes exactly the run's topics
    whose catalogue ``writers`` name the role (WRITE, LITERAL); its groups and transactional ids are
    ``dora.<run_id>.<component>*`` (:func:`own_components`), so it can neither commit offsets for, nor fence,
    another run's roles or another role of its own run (readers' group ids ``dora-*`` never commit).

    Without *run_id* (``launcher`` and ``operator`` only): READ on every ``dora.`` topic and group, and WRITE on
    ``dora.runs``; the launcher, which makes and watches every run, also WRITE on the ``dora.`` prefix. An
    operator's tool that writes into a run (the monitor's dead letters, ``replay refeed``) needs the operator
    granted for that run too. A role of a run is always granted for its run. Idempotence needs no
    IDEMPOTENT_WRITE since Kafka 3.0 (WRITE implies it).
    """
    if role not in ROLES:
        raise ValueError(f"unknown DORA role {role!r}; roles: {ROLES}")
    if run_id is None and role not in ("launcher", "operator"):
        raise ValueError(f"a {role} is granted for its run: pass run_id (decision 0063)")
    own = [TRANSACTIONAL_PREFIX] if run_id is None else [f"dora.{run_id}.{c}" for c in own_components(role)]
    groups = [GROUP_PREFIX] if run_id is None else [*own, "dora-"]
    reads = [Grant("TOPIC", TOPIC_PREFIX if run_id is None else f"dora.{topics.check_run_id(run_id)}.",
                   "PREFIXED", "READ")]
    if run_id is not None:  # and the run registry
        reads += [Grant("TOPIC", name, "LITERAL", "READ") for name in sorted(topics.GLOBAL_TOPICS)]
    out = [*reads, *(Grant("GROUP", g, "PREFIXED", "READ") for g in groups)]
    if role == "operator":
        writers = {"monitor", *OPERATOR_TOOLS}
        out.append(Grant("GROUP", "chaos-", "PREFIXED", "READ"))  # bench/chaos.py's watcher group
    elif role == "launcher":
        writers = {"run"}
        out += [Grant("TOPIC", TOPIC_PREFIX, "PREFIXED", "CREATE"),  # ensure_topics: create, grow requests
                Grant("TOPIC", TOPIC_PREFIX, "PREFIXED", "ALTER")]
    else:
        writers = {role}
    names = [s.name for s in topics.catalogue() if writers & set(s.writers)]
    if run_id is None:
        out += [Grant("TOPIC", name, "LITERAL", "WRITE") for name in names if name in topics.GLOBAL_TOPICS]
        if role == "launcher":  # it makes every run, and watches each (its dead letters go to the run's dlq)
            out.append(Grant("TOPIC", TOPIC_PREFIX, "PREFIXED", "WRITE"))
    else:
        out += [Grant("TOPIC", topics.in_run(run_id, name), "LITERAL", "WRITE") for name in dict.fromkeys(names)]
    if role in TRANSACTIONAL_ROLES:
        out += [Grant("TRANSACTIONAL_ID", t, "PREFIXED", "WRITE") for t in own]
    return tuple(out)


def own_components(role: str) -> tuple[str, ...]:
    """The component names under which ``role`` commits offsets and runs transactions in a run
    (``dora.<run>.<component>...``): an instance's ``rollout-<i>``, the outside reward service's group beside the
    scorer's, the operator's tools; one role's grant never covers another role's group or transactional id."""
    return {"rollout": ("rollout-",), "scorer": ("scorer", "reward-service"),
            "operator": OPERATOR_TOOLS}.get(role, (role,))


def _openssl(args: list[str], cwd: Path) -> None:
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError as exc:
        raise BrokerSecurityError("the `openssl` CLI is needed to make the broker's TLS material") from exc
    if proc.returncode != 0:
        raise BrokerSecurityError(f"openssl {args[0]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _san(hosts: Iterable[str]) -> str:
    """``subjectAltName`` value: every host (IP or DNS entry) and localhost, once each."""
    return ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in dict.fromkeys([*hosts, "localhost"]))


_CNF = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = {cn}
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[broker_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = {san}
"""


@dataclass(frozen=True)
class BrokerSecrets:
    """The material of one secured broker or cluster (all nodes share it); see the module docstring."""

    directory: Path
    admin_user: str
    controller_user: str
    admin_password: str = field(repr=False)
    controller_password: str = field(repr=False)

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def keystore_file(self) -> Path:
        return self.directory / "broker.pem"

    @property
    def admin_password_file(self) -> Path:
        return self.directory / "admin.password"

    @property
    def client_config_file(self) -> Path:
        """A ``DORA_KAFKA_CLIENT_CONFIG`` TOML file (0600) for the admin user (password by file)."""
        return self.directory / "client.toml"

    def admin(self) -> ClientSecurity:
        """Client security of the admin (super user), password by file."""
        return ClientSecurity("SASL_SSL", MECHANISM, self.admin_user, self.admin_password, self.ca_file,
                              password_file=self.admin_password_file)

    def server_properties(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        """Listener, TLS, SASL and authorizer settings of one node (values hold passwords: file is 0600)."""
        scram = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{self.admin_user}" '
                 f'password="{self.admin_password}";')
        c_user, c_pw = self.controller_user, self.controller_password
        plain = (f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{c_user}" '
                 f'password="{c_pw}" user_{c_user}="{c_pw}";')
        lst = CLIENT_LISTENER.lower()
        return {
            "listeners": f"{CLIENT_LISTENER}://{host}:{port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"{CLIENT_LISTENER}://{host}:{port}",
            "inter.broker.listener.name": CLIENT_LISTENER,
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": f"CONTROLLER:SASL_SSL,{CLIENT_LISTENER}:SASL_SSL",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            "sasl.mechanism.controller.protocol": "PLAIN",
            f"listener.name.{lst}.sasl.enabled.mechanisms": MECHANISM,
            f"listener.name.{lst}.{MECHANISM.lower()}.sasl.jaas.config": scram,
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": plain,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore_file),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca_file),
            "ssl.client.auth": "none",
            "ssl.endpoint.identification.algorithm": "https",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{self.admin_user};User:{c_user}",
        }

    def jvm_hosts_file(self, path: Path, hosts: Iterable[str]) -> Path:
        """Write the broker JVM's name service (``-Djdk.net.hosts.file``): *hosts* that are names, resolved
        here, and localhost, so no lookup waits on DNS. Kafka's SASL client side looks up the name of every
        peer address (``InetAddress.getHostName``); where DNS is unreachable (a network namespace) each
        inter-broker/controller connection would stall for the resolver's timeout, past Kafka's connection
        setup timeout. An address missing from the file resolves to itself at once."""
        lines = ["127.0.0.1 localhost"]
        for h in hosts:
            if h == "localhost" or _is_ip(h):
                continue
            with contextlib.suppress(OSError):
                lines.append(f"{socket.gethostbyname(h)} {h}")
        path.write_text("\n".join(lines) + "\n")
        return path

    def format_args(self) -> list[str]:
        """``kafka-storage format`` arguments that bootstrap the admin's SCRAM credential (hold its password:
        pass them in a 0600 argument file, never on a command line)."""
        return ["--add-scram", f"{MECHANISM}=[name={self.admin_user},password={self.admin_password}]"]


@dataclass(frozen=True)
class BrokerSecurity:
    """What to secure: the hosts the certificate covers, the user names, where the material lives.

    *directory* None: the broker puts it in ``<data dir>/security`` (a cluster: ``<cluster dir>/security``).
    """

    hosts: tuple[str, ...] = ("127.0.0.1",)
    directory: Path | None = None
    admin_user: str = "admin"
    controller_user: str = "controller"
    cert_days: int = 825

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("BrokerSecurity needs at least one host for the certificate")
        if self.admin_user == self.controller_user:
            raise ValueError("the admin and controller users must differ")

    def with_hosts(self, *hosts: str) -> BrokerSecurity:
        """This security with *hosts* added to the certificate's SAN (kept in order, no duplicates)."""
        merged = tuple(dict.fromkeys((*self.hosts, *hosts)))
        return BrokerSecurity(merged, self.directory, self.admin_user, self.controller_user, self.cert_days)

    def materialize(self, default_dir: Path) -> BrokerSecrets:
        """Create whatever is missing (CA, broker certificate, passwords, client config) and return it all.

        Idempotent: existing material is kept; the broker certificate is renewed when the hosts changed.
        """
        d = (self.directory or default_dir).expanduser().resolve()
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        pw = {}
        for name in ("admin", "controller"):
            f = d / f"{name}.password"
            if not f.is_file():
                write_private(f, secrets.token_urlsafe(24) + "\n")
            pw[name] = f.read_text().strip()
        if not (d / "ca.pem").is_file() or not (d / "ca.key").is_file():
            self._make_ca(d)
        hosts_file = d / "broker.hosts.json"
        want = sorted(set(self.hosts))
        have = json.loads(hosts_file.read_text()) if hosts_file.is_file() else None
        if have != want or not (d / "broker.pem").is_file():
            self._make_broker_cert(d)
            hosts_file.write_text(json.dumps(want))
        out = BrokerSecrets(d, self.admin_user, self.controller_user, pw["admin"], pw["controller"])
        if not out.client_config_file.is_file():
            write_client_config(out.client_config_file, out.admin())
        return out

    def _make_ca(self, d: Path) -> None:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            t = Path(tmp)
            (t / "ca.cnf").write_text(_CNF.format(cn="dora-rl local Kafka CA", san="DNS:localhost"))
            _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "ca.key"], t)
            _openssl(["req", "-x509", "-new", "-key", "ca.key", "-config", "ca.cnf", "-extensions", "ca_ext",
                      "-sha256", "-days", "3650", "-out", "ca.pem"], t)
            os.chmod(t / "ca.key", 0o600)
            (t / "ca.key").replace(d / "ca.key")
            (t / "ca.pem").replace(d / "ca.pem")

    def _make_broker_cert(self, d: Path) -> None:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            t = Path(tmp)
            (t / "broker.cnf").write_text(_CNF.format(cn="dora-rl Kafka broker", san=_san(self.hosts)))
            _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "broker.key"], t)
            _openssl(["req", "-new", "-key", "broker.key", "-config", "broker.cnf", "-out", "broker.csr"], t)
            _openssl(["x509", "-req", "-in", "broker.csr", "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                      "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(self.cert_days), "-sha256",
                      "-extfile", "broker.cnf", "-extensions", "broker_ext", "-out", "broker.crt"], t)
            pem = (t / "broker.key").read_bytes() + (t / "broker.crt").read_bytes() + (d / "ca.pem").read_bytes()
            write_private(t / "broker.pem", pem.decode())
            (t / "broker.pem").replace(d / "broker.pem")


class SecurityAdmin:
    """SCRAM users and ACLs on a secured cluster, through a confluent-kafka AdminClient as a super user."""

    def __init__(self, bootstrap: str, security: ClientSecurity, timeout: float = 30.0) -> None:
        from confluent_kafka.admin import AdminClient

        self.timeout = timeout
        self._admin = AdminClient(client_config(bootstrap, security=security))

    def create_user(self, name: str, password: str, iterations: int = 8192) -> None:
        """Create (or reset the password of) SCRAM-SHA-512 user *name*; returns once the broker knows it."""
        from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

        if not name or not password:
            raise ValueError("a SCRAM user needs a name and a non-empty password")
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, iterations)
        futs = self._admin.alter_user_scram_credentials([UserScramCredentialUpsertion(name, info, password.encode())],
                                                        request_timeout=self.timeout)
        try:
            futs[name].result(timeout=self.timeout)
        except Exception as exc:  # KafkaException: name the user and the broker's reason, never the password
            raise BrokerSecurityError(f"creating SCRAM user {name!r} failed: {exc}") from exc
        self._wait(lambda: self._user_known(name), f"SCRAM user {name!r} not visible")

    def _user_known(self, name: str) -> bool:
        try:
            res = self._admin.describe_user_scram_credentials([name], request_timeout=self.timeout)
            assert isinstance(res, dict)  # a dict of futures when users are named
            return bool(res[name].result(timeout=self.timeout).scram_credential_infos)
        except Exception:
            return False

    def grant_role(self, principal: str, role: str, run_id: str | None = None) -> int:
        """Create the ALLOW ACLs of DORA *role* (:func:`role_grants`, for *run_id* only when given) for
        *principal* (``User:<name>``, or a bare user name); returns how many. Idempotent; returns once the
        broker enforces them."""
        from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

        principal = principal if ":" in principal else f"User:{principal}"
        kinds = {"TOPIC": ResourceType.TOPIC, "GROUP": ResourceType.GROUP,
                 "TRANSACTIONAL_ID": ResourceType.TRANSACTIONAL_ID, "CLUSTER": ResourceType.BROKER}
        bindings = [AclBinding(kinds[g.resource], g.name, ResourcePatternType[g.pattern], principal, "*",
                               AclOperation[g.operation], AclPermissionType.ALLOW) for g in role_grants(role, run_id)]
        for binding, fut in self._admin.create_acls(bindings, request_timeout=self.timeout).items():
            try:
                fut.result(timeout=self.timeout)
            except Exception as exc:
                raise BrokerSecurityError(f"granting {role} to {principal}: {binding} failed: {exc}") from exc
        self._wait(lambda: self._acl_count(principal) >= len(set(role_grants(role, run_id))),
                   f"ACLs of {principal} not visible")
        return len(bindings)

    def _acl_count(self, principal: str) -> int:
        try:
            res = self._admin.describe_acls(_principal_filter(principal), request_timeout=self.timeout)
            return len(res.result(timeout=self.timeout))
        except Exception:
            return -1

    def revoke_all(self, principal: str) -> None:
        """Delete every ACL of *principal*."""
        principal = principal if ":" in principal else f"User:{principal}"
        flt = _principal_filter(principal)
        for fut in self._admin.delete_acls([flt], request_timeout=self.timeout).values():
            fut.result(timeout=self.timeout)

    def _wait(self, ok: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ok():
            if time.monotonic() > deadline:
                raise BrokerSecurityError(f"{what} after {self.timeout:.0f}s")
            time.sleep(0.1)


def _principal_filter(principal: str) -> Any:
    """An ACL filter matching every ACL of *principal* (None = any, which confluent-kafka's hints omit)."""
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, principal, None,  # type: ignore[arg-type]
                            AclOperation.ANY, AclPermissionType.ANY)
