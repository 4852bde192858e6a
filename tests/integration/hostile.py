"""Issue 32's takeover attempts against a live run on a secured cluster (SASL_SSL, per-role users, ACLs per run
and role): a principal of another run, and the run's own rollout principal writing what is not its own, try to
read the run, announce a version, finish the run, plant a reward, inject a generated trajectory, withdraw a group
and commit offsets for another role. Each must be refused by the broker (a run's topics are its own and granted to
its principals only: decision 0063), or passed by by the reader it targets (a run record on the shared
``dora.runs`` not signed with the run's token); :meth:`Attack.check` then requires that the run ended as if
nothing happened. (tests/integration is on sys.path.)"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

OTHER = "other-run"
"""The run the foreign principal belongs to (its grants), whose token and scorer key it signs with."""
FOREIGN_ROLES = ("trainer", "scorer", "launcher", "rollout")
"""What the foreign principal may do in its own run: announce, end a run (``done``, run records), score, refuse,
generate."""


class Attack:
    """Called once the run has trained a step (``run_across_namespaces(training=...)``); then :meth:`check`."""

    def __init__(self, admin: Any, bootstrap: str, ca: Path, dora_home: Path, rollout_user: Any) -> None:
        from dora_rl.infra.kafka import security as ks

        self.bootstrap, self.dora_home, self.rollout_user = bootstrap, dora_home, rollout_user
        name, password = f"foreign-{uuid.uuid4().hex[:6]}", f"pw-{uuid.uuid4().hex}"
        admin.create_user(name, password)
        for role in FOREIGN_ROLES:
            admin.grant_role(f"User:{name}", role, run_id=OTHER)
        self.foreign = ks.ClientSecurity("SASL_SSL", username=name, password=password, ca_file=ca)
        self.written: dict[str, tuple[str, int, int]] = {}  # attempt -> where the broker put it
        self.refused: dict[str, str] = {}  # attempt -> the broker's error

    def __call__(self, run_id: str) -> bool:
        """The attempts, once the run has a version and a trajectory to forge from (False: not yet)."""
        from dora_rl.infra.kafka import topics
        from dora_rl.infra.kafka.runs import get_run
        from dora_rl.infra.kafka.signing import signed
        from dora_rl.infra.weights.announcements import sign
        from dora_rl.schemas.records import DeadLetter, Metric, PolicyVersion, RunInfo, Trajectory

        info: RunInfo = get_run(self.bootstrap, run_id)
        ann = _last(self.bootstrap, info, topics.VERSIONS, PolicyVersion)
        traj = _last(self.bootstrap, info, topics.TRAJECTORIES, Trajectory)
        if ann is None or traj is None:
            return False
        key = "the other run's token"
        records = {  # the run's own topics (dora.runs is shared by every run)
            "announce": (topics.VERSIONS, sign(ann.replace(version=ann.version + 50, holders=("10.0.0.66:1",),
                                                           signature=None), key)),
            "finish_record": (topics.RUNS, signed(info.replace(state="FINISHED", summary_json="{}", signature=None),
                                                  key)),
            "finish_done": (topics.METRICS, signed(Metric(run_id=run_id, component="trainer", name="done",
                                                          value=4.0, ts_ms=0), key)),
            "plant_reward": (topics.SCORED, signed(traj.replace(reward=1.0, signature=None), key)),
            "inject_trajectory": (topics.TRAJECTORIES, signed(traj.replace(response_text="forged", signature=None),
                                                              key)),
            "withdraw": (topics.DLQ, signed(DeadLetter(component="rollout-0", reason="forged", error_type="engine",
                                                       source_topic=topics.REQUESTS, source_partition=0,
                                                       source_offset=0, ts_ms=0, run_id=run_id,
                                                       group_id=traj.group_id), key)),
        }
        self._produce(self.foreign, "foreign", run_id, records)
        self._produce(self.rollout_user, "own_rollout", run_id,  # not the rollout role's topics
                      {name: records[name] for name in ("announce", "finish_record", "plant_reward")})
        self._read(self.foreign, "foreign_read", topics.in_run(run_id, topics.VERSIONS))
        for who, sec in (("foreign", self.foreign), ("own_rollout", self.rollout_user)):
            self._commit(sec, f"{who}_commit_offsets", f"dora.{run_id}.assembler")
        return True

    def _produce(self, security: Any, who: str, run_id: str, records: dict[str, tuple[str, Any]]) -> None:
        """Each record to the run's topic from one producer of ``security``; each attempt's outcome as the broker
        reports it."""
        from confluent_kafka import Producer

        from dora_rl.infra.kafka import security as ks
        from dora_rl.infra.kafka import topics

        producer = Producer(ks.client_config(self.bootstrap, security=security, **{"message.timeout.ms": 20000}))
        for name, (topic, record) in records.items():
            def report(err: Any, msg: Any, attempt: str = f"{who}_{name}") -> None:
                if err is None:
                    self.written[attempt] = (msg.topic(), msg.partition(), msg.offset())
                else:
                    self.refused[attempt] = err.name()
            value, headers = record.encode()
            producer.produce(topics.in_run(run_id, topic), value, b"forged", partition=0, headers=headers,
                             on_delivery=report)
        producer.flush(30)
        assert all(f"{who}_{n}" in {**self.written, **self.refused} for n in records), (self.written, self.refused)

    def _read(self, security: Any, attempt: str, topic: str) -> None:
        """Read ``topic`` as ``security``: the broker's refusal, or the record the read got."""
        from confluent_kafka import Consumer, KafkaError

        from dora_rl.infra.kafka import security as ks

        errors: list[Any] = []
        consumer = Consumer(ks.client_config(self.bootstrap, security=security, **{
            "group.id": f"dora-reader-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "error_cb": errors.append}))
        try:
            consumer.subscribe([topic])
            for _ in range(40):
                if errors:
                    self.refused[attempt] = errors[0].name()
                    return
                for msg in consumer.consume(10, 0.5):
                    if msg.error() is not None and msg.error().code() != KafkaError._PARTITION_EOF:
                        self.refused[attempt] = msg.error().name()
                        return
                    if msg.error() is None:
                        self.written[attempt] = (topic, msg.partition() or 0, msg.offset() or 0)  # read a record
                        return
        finally:
            consumer.close()
        self.refused.setdefault(attempt, "neither a record nor a refusal in 20 s")

    def _commit(self, security: Any, attempt: str, group: str) -> None:
        from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
        from confluent_kafka.admin import AdminClient

        from dora_rl.infra.kafka import security as ks
        from dora_rl.infra.kafka import topics

        admin = AdminClient(ks.client_config(self.bootstrap, security=security))
        futures = admin.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, [TopicPartition(topics.in_run(group.split(".")[1], topics.SCORED),
                                                                 0, 0)])])
        try:
            [f.result(30) for f in futures.values()]
            self.written[attempt] = (group, 0, 0)
        except KafkaException as exc:
            self.refused[attempt] = exc.args[0].name()

    def check(self, run_id: str) -> None:
        """Every attempt refused by the broker or passed by with its reader's dead letter; the run as if untouched."""
        from dora_rl.consumers.audit import audit_run
        from dora_rl.infra.kafka.runs import get_run

        broker_refused = {f"foreign_{n}": "TOPIC_AUTHORIZATION_FAILED" for n in (
            "read", "announce", "finish_done", "plant_reward", "inject_trajectory", "withdraw")}
        broker_refused.update({f"own_rollout_{n}": "TOPIC_AUTHORIZATION_FAILED" for n in (
            "announce", "finish_record", "plant_reward")})
        broker_refused.update({f"{who}_commit_offsets": "GROUP_AUTHORIZATION_FAILED"
                               for who in ("foreign", "own_rollout")})
        assert self.refused == broker_refused, (self.refused, self.written)
        assert set(self.written) == {"foreign_finish_record"}, self.written  # dora.runs: shared; passed by (below)
        token = (self.dora_home / "runs" / run_id / "weight-token").read_text().strip()
        genuine = get_run(self.bootstrap, run_id, token)
        assert genuine.state == "FINISHED" and genuine.summary_json != "{}", genuine.summary_json  # the trainer's
        report = audit_run(self.bootstrap, run_id, token, token)  # started by hand: scores signed with the token
        assert report.verdict == "PASS" and not report.refused_groups, report.render()


def _last(bootstrap: str, info: Any, topic: str, cls: type) -> Any:
    """The run's newest ``cls`` record on ``topic`` (None: none yet)."""
    from dora_rl.infra.kafka.runs import read_run

    found = None
    for msg in read_run(bootstrap, info, topic):
        rec = cls.decode(msg.value(), msg.headers())
        if rec.run_id == info.run_id:
            found = rec
    return found
