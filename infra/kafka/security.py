"""Client-side Kafka security: one :class:`ClientSecurity` per process, applied to every client it opens.

Where it comes from (read once, :func:`current`): the environment variables ``DORA_KAFKA_SECURITY_PROTOCOL``,
``DORA_KAFKA_SASL_MECHANISM``, ``DORA_KAFKA_SASL_USERNAME``, ``DORA_KAFKA_SASL_PASSWORD`` or
``DORA_KAFKA_SASL_PASSWORD_FILE``, ``DORA_KAFKA_SSL_CA_FILE``, and/or the TOML file named by
``DORA_KAFKA_CLIENT_CONFIG`` (keys :data:`FILE_KEYS`; relative paths are relative to the file). A
variable set (non-empty) in the environment wins over the file, key by key; the password counts as one
key (``*_PASSWORD`` or ``*_PASSWORD_FILE``, never both from one source). Nothing set: PLAINTEXT.

Invariants:

- the password never appears in ``repr``/``str`` of anything here, in an error message or in a log line
  (:class:`RedactSecrets` scrubs log records as a second line of defence), and never in argv:
  :func:`child_env` hands it to child processes as a 0600 file named in the environment;
- ``SASL_SSL`` always comes with a username, a password and a CA file (checked when built), and the
  broker's certificate is verified, host name included (librdkafka's and Python's defaults, kept);
- :data:`SECURITY_ERROR_NAMES` are the Kafka error codes that no retry can cure (wrong credentials, a
  missing ACL): clients raise :class:`KafkaSecurityError` naming the code instead of retrying.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

if TYPE_CHECKING:
    import ssl

    from confluent_kafka import KafkaError
    from faust.auth import SASLCredentials

__all__ = [
    "ENV_VARS",
    "FILE_KEYS",
    "SECURITY_ERROR_NAMES",
    "ClientSecurity",
    "KafkaSecurityError",
    "RedactSecrets",
    "SecurityConfigError",
    "aiokafka_kwargs",
    "check_kafka_error",
    "child_env",
    "client_config",
    "current",
    "effective",
    "faust_broker_credentials",
    "is_security_error",
    "load",
    "on_client_error",
    "security_errors_fatal",
    "using",
    "write_client_config",
    "write_private",
]

Protocol = Literal["PLAINTEXT", "SASL_SSL"]
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")

CONFIG_ENV = "DORA_KAFKA_CLIENT_CONFIG"
#: TOML key -> environment variable carrying the same setting.
ENV_VARS: dict[str, str] = {
    "security_protocol": "DORA_KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "DORA_KAFKA_SASL_MECHANISM",
    "sasl_username": "DORA_KAFKA_SASL_USERNAME",
    "sasl_password": "DORA_KAFKA_SASL_PASSWORD",
    "sasl_password_file": "DORA_KAFKA_SASL_PASSWORD_FILE",
    "ssl_ca_file": "DORA_KAFKA_SSL_CA_FILE",
}
FILE_KEYS = frozenset(ENV_VARS)

#: Kafka error codes (``KafkaError`` attribute names) that mean "wrong credentials" or "no ACL": fatal.
SECURITY_ERROR_NAMES: tuple[str, ...] = (
    "_AUTHENTICATION",
    "SASL_AUTHENTICATION_FAILED",
    "TOPIC_AUTHORIZATION_FAILED",
    "GROUP_AUTHORIZATION_FAILED",
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
    "CLUSTER_AUTHORIZATION_FAILED",
)

log = logging.getLogger(__name__)


class SecurityConfigError(ValueError):
    """The client security settings are incomplete or contradictory (the message names the source)."""


class KafkaSecurityError(RuntimeError):
    """Kafka refused this client's credentials or permissions: retrying cannot help.

    ``code_name`` is the Kafka error code's name (e.g. ``TOPIC_AUTHORIZATION_FAILED``), also in the message.
    """

    def __init__(self, code_name: str, detail: str, where: str = "") -> None:
        super().__init__(f"{code_name}: {detail}" + (f" ({where})" if where else ""))
        self.code_name = code_name


@dataclass(frozen=True)
class ClientSecurity:
    """How a client authenticates to Kafka and which CA it trusts (see the module docstring)."""

    protocol: Protocol = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None
    password_file: Path | None = None
    """The 0600 file the password was read from, if any (handed on to child processes as is)."""

    def __post_init__(self) -> None:
        if self.protocol not in get_args(Protocol):
            raise SecurityConfigError(f"security protocol {self.protocol!r} unsupported; use one of "
                                      f"{get_args(Protocol)}")
        if self.mechanism not in MECHANISMS:
            raise SecurityConfigError(f"SASL mechanism {self.mechanism!r} unsupported; use one of {MECHANISMS}")
        if self.protocol == "PLAINTEXT":
            given = [n for n, v in (("username", self.username), ("password", self.password),
                                    ("CA file", self.ca_file)) if v]
            if given:
                raise SecurityConfigError(f"{', '.join(given)} given but the security protocol is PLAINTEXT: "
                                          f"set {ENV_VARS['security_protocol']}=SASL_SSL (or security_protocol)")
            return
        missing = [n for n, v in (("username", self.username), ("password", self.password),
                                  ("CA file", self.ca_file)) if not v]
        if missing:
            raise SecurityConfigError(f"{self.protocol} needs a SASL username, a password and a CA file; missing: "
                                      f"{', '.join(missing)} (env {ENV_VARS['sasl_username']}, "
                                      f"{ENV_VARS['sasl_password']}/{ENV_VARS['sasl_password_file']}, "
                                      f"{ENV_VARS['ssl_ca_file']} or the file named by {CONFIG_ENV})")

    @property
    def secure(self) -> bool:
        return self.protocol != "PLAINTEXT"

    def librdkafka(self) -> dict[str, Any]:
        """The confluent-kafka (librdkafka) settings of this security, without ``bootstrap.servers``."""
        if not self.secure:
            return {}
        return {"security.protocol": self.protocol, "sasl.mechanisms": self.mechanism,
                "sasl.username": self.username, "sasl.password": self.password,
                "ssl.ca.location": str(self.ca_file)}


PLAINTEXT = ClientSecurity()


def _read_password(path: Path, source: str) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the SASL password file {path} ({source}): {exc.strerror}") from exc
    pw = text.rstrip("\r\n")
    if not pw:
        raise SecurityConfigError(f"the SASL password file {path} ({source}) is empty")
    return pw


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SecurityConfigError(f"cannot read {CONFIG_ENV}={path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SecurityConfigError(f"{CONFIG_ENV}={path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise SecurityConfigError(f"{path}: unknown keys {unknown}; known: {sorted(FILE_KEYS)}")
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    if bad:
        raise SecurityConfigError(f"{path}: keys {sorted(bad)} must be strings")
    for k in ("sasl_password_file", "ssl_ca_file"):
        if data.get(k):
            data[k] = str((path.parent / data[k]).expanduser())
    return data


def load(environ: Mapping[str, str] | None = None) -> ClientSecurity:
    """Build the :class:`ClientSecurity` described by *environ* (default ``os.environ``), see the module doc."""
    env = os.environ if environ is None else environ
    cfg_path = env.get(CONFIG_ENV) or ""
    sources: dict[str, tuple[str, str]] = {}  # key -> (value, where it came from)
    if cfg_path:
        for k, v in _from_file(Path(cfg_path).expanduser()).items():
            if v:
                sources[k] = (v, f"{CONFIG_ENV}={cfg_path}")
    env_vals = {k: env.get(var) or "" for k, var in ENV_VARS.items()}
    if env_vals["sasl_password"] and env_vals["sasl_password_file"]:
        raise SecurityConfigError(f"set {ENV_VARS['sasl_password']} or {ENV_VARS['sasl_password_file']}, not both")
    if "sasl_password" in sources and "sasl_password_file" in sources:
        raise SecurityConfigError(f"{cfg_path}: set sasl_password or sasl_password_file, not both")
    if env_vals["sasl_password"] or env_vals["sasl_password_file"]:  # the env's password wins as a whole
        sources.pop("sasl_password", None)
        sources.pop("sasl_password_file", None)
    for k, v in env_vals.items():
        if v:
            sources[k] = (v, f"env {ENV_VARS[k]}")
    password, password_file = None, None
    if "sasl_password" in sources:
        password = sources["sasl_password"][0]
    elif "sasl_password_file" in sources:
        value, where = sources["sasl_password_file"]
        password_file = Path(value).expanduser()
        password = _read_password(password_file, where)
    ca = sources.get("ssl_ca_file", ("", ""))[0]
    protocol = sources.get("security_protocol", ("PLAINTEXT", ""))[0].upper()
    return ClientSecurity(protocol=protocol,  # type: ignore[arg-type]  # checked in __post_init__
                          mechanism=sources.get("sasl_mechanism", ("SCRAM-SHA-512", ""))[0].upper(),
                          username=sources.get("sasl_username", (None, ""))[0], password=password,
                          ca_file=Path(ca).expanduser() if ca else None, password_file=password_file)


@functools.cache
def current() -> ClientSecurity:
    """This process's security, loaded once from ``os.environ`` (``current.cache_clear()`` reloads it)."""
    sec = load()
    if sec.password:
        RedactSecrets.install(sec.password)
    if sec.secure:
        log.info("Kafka clients use %s/%s as %s (CA %s)", sec.protocol, sec.mechanism, sec.username, sec.ca_file)
    return sec


_override: contextvars.ContextVar[ClientSecurity | None] = contextvars.ContextVar("dora_kafka_security",
                                                                                 default=None)


@contextlib.contextmanager
def using(security: ClientSecurity) -> Iterator[ClientSecurity]:
    """Within this block (this thread/task), clients built without an explicit security use *security*
    instead of :func:`current` (a tool acting as another user; tests)."""
    token = _override.set(security)
    try:
        yield security
    finally:
        _override.reset(token)


def effective(security: ClientSecurity | None = None) -> ClientSecurity:
    """*security* if given, else the one :func:`using` set, else :func:`current`."""
    return security or _override.get() or current()


def client_config(bootstrap: str, *, security: ClientSecurity | None = None, **extra: Any) -> dict[str, Any]:
    """Settings for a confluent-kafka Producer/Consumer/AdminClient: ``bootstrap.servers``, the security
    of :func:`effective` (*security*, else :func:`using`'s, else :func:`current`), then *extra*
    (librdkafka keys, which win).

    The returned dict holds the password: pass it to the client, never log it.
    """
    cfg: dict[str, Any] = {"bootstrap.servers": bootstrap}
    cfg.update(effective(security).librdkafka())
    cfg.update(extra)
    return cfg


def aiokafka_kwargs(security: ClientSecurity | None = None) -> dict[str, Any]:
    """Keyword arguments for ``AIOKafkaProducer``/``AIOKafkaConsumer``/``AIOKafkaAdminClient``."""
    sec = effective(security)
    if not sec.secure:
        return {"security_protocol": "PLAINTEXT"}
    return {"security_protocol": sec.protocol, "sasl_mechanism": sec.mechanism,
            "sasl_plain_username": sec.username, "sasl_plain_password": sec.password,
            "ssl_context": _ssl_context(sec)}


def _ssl_context(sec: ClientSecurity) -> ssl.SSLContext:
    from aiokafka.helpers import create_ssl_context

    return create_ssl_context(cafile=str(sec.ca_file))


def faust_broker_credentials(security: ClientSecurity | None = None) -> SASLCredentials | None:
    """``faust.App(..., broker_credentials=...)``: SASL over TLS, or None for PLAINTEXT."""
    sec = effective(security)
    if not sec.secure:
        return None
    from faust.auth import SASLCredentials

    return SASLCredentials(username=sec.username, password=sec.password, ssl_context=_ssl_context(sec),
                           mechanism=sec.mechanism)


def child_env(security: ClientSecurity, directory: Path | None = None) -> dict[str, str]:
    """Environment variables that give a child process *security*, the password by file only.

    The password file is the one it was loaded from, else a new 0600 file ``sasl-password`` in
    *directory* (default: a new private temporary directory; the caller owns its removal). The result
    blanks ``DORA_KAFKA_SASL_PASSWORD`` and ``DORA_KAFKA_CLIENT_CONFIG`` so nothing inherited overrides it.
    """
    env = {var: "" for var in ENV_VARS.values()}
    env[CONFIG_ENV] = ""
    env[ENV_VARS["security_protocol"]] = security.protocol
    if not security.secure:
        return env
    pw_file = security.password_file
    if pw_file is None:
        d = directory if directory is not None else Path(tempfile.mkdtemp(prefix="dora-kafka-"))
        d.mkdir(parents=True, exist_ok=True)
        pw_file = d / "sasl-password"
        write_private(pw_file, (security.password or "") + "\n")
    env.update({ENV_VARS["sasl_mechanism"]: security.mechanism, ENV_VARS["sasl_username"]: security.username or "",
                ENV_VARS["sasl_password_file"]: str(pw_file), ENV_VARS["ssl_ca_file"]: str(security.ca_file)})
    return env


def write_client_config(path: Path, security: ClientSecurity) -> Path:
    """Write *security* as a 0600 TOML file for ``DORA_KAFKA_CLIENT_CONFIG``; the password goes in by its
    file when it has one (then the TOML holds no secret), else inline."""
    keys: dict[str, object] = {"security_protocol": security.protocol}
    if security.secure:
        keys.update(sasl_mechanism=security.mechanism, sasl_username=security.username,
                    ssl_ca_file=str(security.ca_file))
        if security.password_file is not None:
            keys["sasl_password_file"] = str(security.password_file)
        else:
            keys["sasl_password"] = security.password
    # a JSON string is a valid TOML basic string (same escapes)
    write_private(path, "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def write_private(path: Path, text: str) -> None:
    """Write *text* to *path* readable by its owner only (created 0600, never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


# -- errors that no retry cures ---------------------------------------------------------------------
#: An ``_AUTHENTICATION`` error whose detail holds this failed for a local reason (the connection dropped or
#: timed out during the SASL handshake, e.g. ``... mechanism handshake failed: Local: Broker transport
#: failure``): librdkafka reconnects, so it is no refusal. A broker's refusal reads ``... failed: Broker: ...``
#: or ``SASL authentication error: ...``.
TRANSPORT_DURING_HANDSHAKE = "handshake failed: Local:"


def is_security_error(err: KafkaError | None) -> bool:
    """True if *err* is one of :data:`SECURITY_ERROR_NAMES` and not a transport failure mid-handshake."""
    if err is None or (err.name() or "") not in SECURITY_ERROR_NAMES:
        return False
    return TRANSPORT_DURING_HANDSHAKE not in (err.str() or "")


def check_kafka_error(err: KafkaError | None, where: str = "") -> None:
    """Raise :class:`KafkaSecurityError` if *err* is a security error; else return."""
    if err is not None and is_security_error(err):
        raise KafkaSecurityError(err.name(), err.str(), where)


def on_client_error(err: KafkaError) -> None:
    """``error_cb`` for confluent-kafka clients: raises :class:`KafkaSecurityError` on a security error (out
    of the poll/consume/flush that served it); logs the others (the client retries what it can)."""
    check_kafka_error(err, "client error callback")
    log.warning("Kafka client error: %s", err)


@contextlib.contextmanager
def security_errors_fatal(where: str) -> Iterator[None]:
    """Turn a ``KafkaException`` carrying a security error into :class:`KafkaSecurityError`; others pass."""
    from confluent_kafka import KafkaError, KafkaException

    try:
        yield
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and is_security_error(err):
            raise KafkaSecurityError(err.name(), err.str(), where) from exc
        raise


class RedactSecrets(logging.Filter):
    """Replaces every registered secret in a log record's message with ``***`` (never drops records).

    :meth:`install` registers a secret and attaches the one shared filter to the root logger's handlers
    (every record propagated to them passes it), so a secret loaded by :func:`current` never reaches a log.
    """

    _secrets: ClassVar[set[str]] = set()
    _shared: ClassVar[RedactSecrets | None] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        msg = record.getMessage()
        clean = msg
        for s in self._secrets:
            clean = clean.replace(s, "***")
        if clean != msg:
            record.msg, record.args = clean, None
        return True

    @classmethod
    def install(cls, secret: str) -> None:
        if len(secret) >= 4:  # a shorter "secret" would scrub ordinary words
            cls._secrets.add(secret)
        if cls._shared is None:
            cls._shared = cls()
        for handler in logging.getLogger().handlers:
            if cls._shared not in handler.filters:
                handler.addFilter(cls._shared)
