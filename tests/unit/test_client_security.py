"""ClientSecurity loading (env vs file, missing fields, secrets kept out of repr/logs) and role grants."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from dora_rl.infra.broker.security import ROLES, BrokerSecurity, role_grants
from dora_rl.infra.kafka import security as ks
from dora_rl.infra.kafka.topics import catalogue, in_run

PW = "s3cret-Pa55word"


def _toml(path: Path, **keys: str) -> Path:
    path.write_text("".join(f'{k} = "{v}"\n' for k, v in keys.items()))
    return path


def test_nothing_set_is_plaintext() -> None:
    sec = ks.load({})
    assert sec == ks.PLAINTEXT and not sec.secure
    assert ks.client_config("h:1", security=sec) == {"bootstrap.servers": "h:1"}
    assert ks.aiokafka_kwargs(sec) == {"security_protocol": "PLAINTEXT"}
    assert ks.faust_broker_credentials(sec) is None


def test_env_only(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    sec = ks.load({"DORA_KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "DORA_KAFKA_SASL_USERNAME": "alice",
                   "DORA_KAFKA_SASL_PASSWORD": PW, "DORA_KAFKA_SSL_CA_FILE": str(ca)})
    assert (sec.protocol, sec.mechanism, sec.username, sec.password, sec.ca_file) == (
        "SASL_SSL", "SCRAM-SHA-512", "alice", PW, ca)
    cfg = ks.client_config("h:1", security=sec, **{"client.id": "x"})
    assert cfg == {"bootstrap.servers": "h:1", "security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512",
                   "sasl.username": "alice", "sasl.password": PW, "ssl.ca.location": str(ca), "client.id": "x"}


def test_file_then_env_wins_key_by_key(tmp_path: Path) -> None:
    pw_file = tmp_path / "pw"
    pw_file.write_text(PW + "\n")
    cfg = _toml(tmp_path / "client.toml", security_protocol="SASL_SSL", sasl_username="from-file",
                sasl_password="file-password", ssl_ca_file="ca.pem")
    from_file = ks.load({"DORA_KAFKA_CLIENT_CONFIG": str(cfg)})
    assert (from_file.username, from_file.password) == ("from-file", "file-password")
    assert from_file.ca_file == tmp_path / "ca.pem"  # relative to the TOML file
    both = ks.load({"DORA_KAFKA_CLIENT_CONFIG": str(cfg), "DORA_KAFKA_SASL_USERNAME": "from-env",
                    "DORA_KAFKA_SASL_PASSWORD_FILE": str(pw_file)})
    assert (both.username, both.password, both.password_file) == ("from-env", PW, pw_file)
    assert both.ca_file == tmp_path / "ca.pem"  # not overridden: the file's value stays


def test_unknown_key_and_missing_fields_are_errors(tmp_path: Path) -> None:
    bad = _toml(tmp_path / "bad.toml", security_protocol="SASL_SSL", sasl_pasword="typo")
    with pytest.raises(ks.SecurityConfigError, match=r"unknown keys.*sasl_pasword"):
        ks.load({"DORA_KAFKA_CLIENT_CONFIG": str(bad)})
    with pytest.raises(ks.SecurityConfigError, match="missing: password, CA file") as exc:
        ks.load({"DORA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "DORA_KAFKA_SASL_USERNAME": "alice"})
    assert "DORA_KAFKA_SSL_CA_FILE" in str(exc.value)
    with pytest.raises(ks.SecurityConfigError, match="PLAINTEXT"):
        ks.load({"DORA_KAFKA_SASL_USERNAME": "alice", "DORA_KAFKA_SASL_PASSWORD": PW})
    with pytest.raises(ks.SecurityConfigError, match="not both"):
        ks.load({"DORA_KAFKA_SASL_PASSWORD": PW, "DORA_KAFKA_SASL_PASSWORD_FILE": "/x"})
    with pytest.raises(ks.SecurityConfigError, match="unsupported"):
        ks.load({"DORA_KAFKA_SECURITY_PROTOCOL": "SSL"})
    with pytest.raises(ks.SecurityConfigError, match="cannot read the SASL password file") as exc:
        ks.load({"DORA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "DORA_KAFKA_SASL_USERNAME": "a",
                 "DORA_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "nope"), "DORA_KAFKA_SSL_CA_FILE": "ca"})


def test_password_never_in_repr_str_or_errors(tmp_path: Path) -> None:
    sec = ks.ClientSecurity("SASL_SSL", username="alice", password=PW, ca_file=tmp_path / "ca.pem")
    assert PW not in repr(sec) and PW not in str(sec) and "alice" in repr(sec)
    with pytest.raises(ks.SecurityConfigError) as exc:
        ks.ClientSecurity("SASL_SSL", username="alice", password=PW)
    assert PW not in str(exc.value)


def test_child_env_passes_the_password_by_0600_file(tmp_path: Path) -> None:
    sec = ks.ClientSecurity("SASL_SSL", username="alice", password=PW, ca_file=tmp_path / "ca.pem")
    env = ks.child_env(sec, tmp_path / "secrets")
    assert PW not in "".join(env.values())
    pw_file = Path(env["DORA_KAFKA_SASL_PASSWORD_FILE"])
    assert pw_file.read_text().strip() == PW and stat.S_IMODE(pw_file.stat().st_mode) == 0o600
    assert env["DORA_KAFKA_SASL_PASSWORD"] == "" and env["DORA_KAFKA_CLIENT_CONFIG"] == ""
    inherited = {"DORA_KAFKA_SASL_PASSWORD": "parent-pw", "DORA_KAFKA_CLIENT_CONFIG": "/parent.toml"}
    child = ks.load({**inherited, **env})  # what the child process loads
    assert child.password == PW and child.username == "alice" and child.password_file == pw_file
    assert ks.child_env(child)["DORA_KAFKA_SASL_PASSWORD_FILE"] == str(pw_file)  # passed on as is


def test_write_client_config_round_trips(tmp_path: Path) -> None:
    pw_file = tmp_path / "pw"
    pw_file.write_text(PW)
    sec = ks.ClientSecurity("SASL_SSL", username="admin", password=PW, ca_file=tmp_path / "ca.pem",
                            password_file=pw_file)
    path = ks.write_client_config(tmp_path / "client.toml", sec)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and PW not in path.read_text()
    assert ks.load({"DORA_KAFKA_CLIENT_CONFIG": str(path)}) == sec


def test_current_is_cached_and_using_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in (*ks.ENV_VARS.values(), "DORA_KAFKA_CLIENT_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    ks.current.cache_clear()
    try:
        assert ks.current() is ks.current() and not ks.current().secure
        other = ks.ClientSecurity("SASL_SSL", username="bob", password=PW, ca_file=tmp_path / "ca.pem")
        with ks.using(other):
            assert ks.client_config("h:1")["sasl.username"] == "bob"
        assert "sasl.username" not in ks.client_config("h:1")
    finally:
        ks.current.cache_clear()


def test_redaction_filter_scrubs_log_records(caplog: pytest.LogCaptureFixture) -> None:
    ks.RedactSecrets.install(PW)
    caplog.handler.addFilter(ks.RedactSecrets._shared)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO):
        logging.getLogger("dora_rl.test").info("config %s", {"sasl.password": PW})
    assert PW not in caplog.text and "***" in caplog.text


def test_role_grants_follow_the_catalogue() -> None:
    """Granted for run r1, a role writes exactly the r1 topics the catalogue names it a writer of, and reads only
    r1's topics and the run registry (decision 0063); cluster-wide grants exist for the launcher and operator
    alone."""
    def grants(r: str, op: str, run_id: str | None = "r1") -> set[tuple[str, str]]:
        return {(g.name, g.pattern) for g in role_grants(r, run_id) if g.operation == op and g.resource == "TOPIC"}

    writes = {r: {name for name, _ in grants(r, "WRITE")} for r in ROLES}
    for spec in catalogue():
        for w in spec.writers:
            if w in writes:
                assert in_run("r1", spec.name) in writes[w], (w, spec.name)
    assert writes["scorer"] == {"dora.r1.rollout.scored", "dora.r1.dlq", "dora.r1.metrics", "dora.r1.state"}
    assert writes["launcher"] == {"dora.runs", "dora.r1.dlq"}
    # operators may re-feed a run (dora-rl replay refeed records a run and writes its batches)
    assert writes["operator"] == {"dora.r1.dlq", "dora.runs", "dora.r1.train.batches"}
    for r in ROLES:
        assert grants(r, "READ") == {("dora.r1.", "PREFIXED"), ("dora.runs", "LITERAL")}, r
        assert not any(name.startswith("dora.r1") and not name.startswith("dora.r1.") for name, _ in grants(r, "WRITE"))
    assert grants("operator", "READ", None) == {("dora.", "PREFIXED")}
    assert grants("operator", "WRITE", None) == {("dora.runs", "LITERAL")}  # a run's topics: granted per run
    assert grants("launcher", "WRITE", None) == {("dora.runs", "LITERAL"), ("dora.", "PREFIXED")}
    for r in set(ROLES) - {"launcher", "operator"}:
        with pytest.raises(ValueError, match="granted for its run"):
            role_grants(r)
    txn = {r for r in ROLES if any(g.resource == "TRANSACTIONAL_ID" for g in role_grants(r, "r1"))}
    assert txn == {"dataset", "orchestrator", "scorer", "assembler", "trainer"}
    with pytest.raises(ValueError, match="unknown DORA role"):
        role_grants("root")
    with pytest.raises(ValueError, match="run id"):
        role_grants("trainer", "r1.evil")


def test_run_scoped_grants_cover_the_roles_own_groups_and_transactions_only() -> None:
    """Granted for one run, a role's GROUP and TRANSACTIONAL_ID prefixes cover its own components' names in that
    run (as the roles name them: ``dora.<run>.<component>...``) and no other role's, nor another run's."""
    from dora_rl.infra.broker.security import own_components

    names = {"trainer": ["trainer"], "orchestrator": ["orchestrator"], "assembler": ["assembler"],
             "scorer": ["scorer", "reward-service"], "dataset": ["dataset"],
             "rollout": ["rollout-0", "rollout-3.versions.1"], "launcher": ["launcher"],
             "monitor": ["monitor.monitor.1"]}
    for role in ROLES:
        grants = [g for g in role_grants(role, run_id="runA") if g.resource in ("GROUP", "TRANSACTIONAL_ID")]
        assert all(g.pattern == "PREFIXED" for g in grants)
        for owner, components in names.items():
            for c in components:
                covered = any(f"dora.runA.{c}".startswith(g.name) for g in grants if g.resource == "GROUP")
                mine = owner == role or (role == "operator" and owner == "monitor")
                assert covered == mine, (role, owner, c)
                assert not any(f"dora.runB.{c}".startswith(g.name) for g in grants if g.name != "dora-")
        assert own_components(role)


def test_broker_material_is_private_and_reused(tmp_path: Path) -> None:
    sec = BrokerSecurity(hosts=("127.0.0.1", "10.1.2.3"))
    m = sec.materialize(tmp_path / "sec")
    for f in (m.keystore_file, m.admin_password_file, m.directory / "ca.key", m.client_config_file):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert stat.S_IMODE(os.stat(m.directory).st_mode) == 0o700
    assert m.admin_password not in repr(m) and m.controller_password not in repr(m)
    assert "BEGIN PRIVATE KEY" in m.keystore_file.read_text()  # PKCS#8, as Kafka's PEM store needs
    first = m.keystore_file.read_bytes()
    again = sec.materialize(tmp_path / "sec")
    assert again == m and again.keystore_file.read_bytes() == first
    grown = sec.with_hosts("10.9.9.9").materialize(tmp_path / "sec")  # a new host: new cert, same CA
    assert grown.keystore_file.read_bytes() != first
    assert grown.admin_password == m.admin_password
    props = m.server_properties("127.0.0.1", 1, 2)
    assert props["allow.everyone.if.no.acl.found"] == "false" and props["super.users"] == "User:admin;User:controller"


@pytest.mark.parametrize(("code", "detail", "fatal"), [
    ("_AUTHENTICATION", "SASL authentication error: Authentication failed during authentication due to "
                        "invalid credentials with SASL mechanism SCRAM-SHA-512", True),
    ("_AUTHENTICATION", "SASL SCRAM-SHA-512 mechanism handshake failed: Broker: Unsupported SASL mechanism: "
                        "broker's supported mechanisms: PLAIN", True),
    ("TOPIC_AUTHORIZATION_FAILED", "Broker: Topic authorization failed", True),
    # the connection dropped during the handshake (seen in CI under load): librdkafka reconnects
    ("_AUTHENTICATION", "GroupCoordinator: SASL SCRAM-SHA-512 mechanism handshake failed: Local: Broker "
                        "transport failure: broker's supported mechanisms: (n/a) (after 0ms in state DOWN)", False),
    ("_TRANSPORT", "Connection refused", False),
])
def test_only_refusals_are_fatal(code: str, detail: str, fatal: bool) -> None:
    from confluent_kafka import KafkaError

    err = KafkaError(getattr(KafkaError, code), detail)
    assert ks.is_security_error(err) is fatal
    if fatal:
        with pytest.raises(ks.KafkaSecurityError, match=code):
            ks.on_client_error(err)
    else:
        ks.on_client_error(err)  # logged, not raised
