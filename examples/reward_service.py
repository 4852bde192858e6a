#!/usr/bin/env python3
"""A standalone reward service for a DORA run: an ordinary Kafka consumer group, exactly once.

Needs only ``confluent_kafka``, ``fastavro`` and the ``.avsc`` files (``--schemas``, default
``dora_rl/schemas/``); it imports nothing of ``dora_rl``. Start the run with ``--reward external`` (so
DORA starts no scorer of its own), then::

    python examples/reward_service.py --bootstrap-servers HOST:PORT --run-id RUN_ID

What it does, per poll of ``dora.rollout.trajectories`` (consumer group ``dora.<run>.reward-service``):

1. decode each record (schemaless Avro; the ``dora.schema.fp`` header names the writer schema, looked up
   among the current and ``history/*`` schemas and resolved into the current one); skip other runs';
2. score it in a worker process, at most ``--timeout-s`` per try and ``--max-attempts`` tries; the
   worker is killed and replaced after a timeout or a crash, so a hung verifier costs a worker, never
   this process. The reward is the task's (``reverse``/``chainsum``, as in the DORA package) or
   ``--reward-fn FILE.py:FUNCTION`` with ``fn(task, reference, completion) -> float`` in [0, 1];
3. in ONE Kafka transaction: the scored trajectory to ``dora.rollout.scored`` (same key
   ``v<policy_version:010d>/<group_id>``, partition ``murmur2(group_id) % num_partitions``, same
   headers), a ``DeadLetter`` to ``dora.dlq`` for each record refused (``error_type`` ``reward``, with
   ``group_id``: DORA withdraws and replaces the whole group), counters to ``dora.metrics``, and the
   consumed offsets (``send_offsets_to_transaction``).

Invariants: a consumed trajectory yields exactly one committed output (scored or dead letter), whatever
is killed when: outputs and offsets commit together or not at all (consumers read ``read_committed``),
and a restarted service (same ``--instance``: same ``transactional.id`` and static ``group.instance.id``)
first aborts its predecessor's open transaction and fences it. Scoring happens before the transaction
opens, so a slow batch cannot time a transaction out; a batch is cut after ``--batch-budget-s`` and the
rest is read again. Kafka security comes from the ``DORA_KAFKA_*`` variables (``--help``). Exits 0 when
the run is recorded FINISHED or FAILED, or on SIGTERM/SIGINT after its current commit.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import importlib.util
import io
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from fastavro.schema import fingerprint, to_parsing_canonical_form

log = logging.getLogger("reward_service")
RUNS = "dora.runs"
TRAJECTORIES, SCORED, DLQ, METRICS = "rollout.trajectories", "rollout.scored", "dlq", "metrics"
"""Names of the run's own topics: every run has its own, ``dora.<run_id>.<name>`` (:meth:`RewardService.topic`)."""
SCHEMA_FILES = {"Trajectory": "trajectory.avsc", "DeadLetter": "dead_letter.avsc", "Metric": "metric.avsc",
                "RunInfo": "run_info.avsc"}
COMPONENT = "reward-service"


# -- wire format: schemaless Avro + headers dora.schema / dora.schema.fp ---------------------------
class Wire:
    """Reader/writer schemas from a schema directory; writers of older sets found by fingerprint."""

    def __init__(self, directory: Path) -> None:
        self.current = {n: self._parse(directory / f) for n, f in SCHEMA_FILES.items()}
        self.writers: dict[str, Any] = {}
        sets = sorted((directory / "history").glob("*/")) if (directory / "history").is_dir() else []
        for d in [*sets, directory]:
            for f in SCHEMA_FILES.values():
                if (d / f).exists():
                    parsed = self._parse(d / f)
                    self.writers[self._fp(parsed)] = parsed

    @staticmethod
    def _parse(path: Path) -> Any:
        return fastavro.parse_schema(json.loads(path.read_text()), named_schemas={})

    @staticmethod
    def _fp(parsed: Any) -> str:  # CRC-64-AVRO (Rabin) of the Parsing Canonical Form, hex
        return str(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))

    def full_name(self, name: str) -> str:
        return str(self.current[name]["name"])

    def encode(self, name: str, datum: dict[str, Any], key: str = "") -> tuple[bytes, list[tuple[str, bytes]]]:
        """Schemaless Avro and the schema headers; with ``key``, ``signature`` is set to the HMAC-SHA256 (hex)
        of the encoding with ``signature`` null (what DORA checks: the scorer key for scores, the weight token
        for refusals)."""
        if key:
            body = self.encode(name, {**datum, "signature": None})[0]
            datum = {**datum, "signature": hmac.new(key.encode(), body, hashlib.sha256).hexdigest()}
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, self.current[name], datum)
        fp = self._fp(self.current[name])
        return buf.getvalue(), [("dora.schema", self.full_name(name).encode()), ("dora.schema.fp", fp.encode())]

    def decode(self, name: str, value: bytes | None, headers: list[tuple[str, bytes]] | None) -> dict[str, Any]:
        """The datum, or ValueError with the reason (the caller dead-letters the record)."""
        try:
            h = {k: v.decode() for k, v in headers or [] if v is not None}
        except UnicodeDecodeError as exc:
            raise ValueError(f"a header is not UTF-8: {exc}") from exc
        if not value:
            raise ValueError(f"empty value where a {name} was expected")
        if h.get("dora.schema", self.full_name(name)) != self.full_name(name):
            raise ValueError(f"record declares schema {h['dora.schema']!r}, expected {self.full_name(name)!r}")
        writer = self.writers.get(h["dora.schema.fp"]) if "dora.schema.fp" in h else self.current[name]
        if writer is None:
            raise ValueError(f"unknown writer schema fingerprint {h['dora.schema.fp']} for {name}")
        buf = io.BytesIO(value)
        try:
            datum = fastavro.schemaless_reader(buf, writer, self.current[name])
        except Exception as exc:
            raise ValueError(f"malformed {name}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(value) or not isinstance(datum, dict):
            raise ValueError(f"malformed {name}: trailing bytes")
        return datum


def _secret(path: str) -> str:
    """The secret in file ``path`` (empty path: none)."""
    return Path(path).read_text().strip() if path else ""


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (the Java client's default partitioner), as an unsigned 32-bit value."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    h = (0x9747B28C ^ len(data)) & mask
    whole = len(data) - len(data) % 4
    for i in range(0, whole, 4):
        k = (int.from_bytes(data[i:i + 4], "little") * m) & mask
        k = ((k ^ (k >> 24)) * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[whole:]
    if tail:
        for j in range(len(tail) - 1, -1, -1):
            h ^= tail[j] << (8 * j)
        h = (h * m) & mask
    h = ((h ^ (h >> 13)) * m) & mask
    return h ^ (h >> 15)


def partition_for(group_id: str, num_partitions: int) -> int:
    """DORA's partition of a group: ``(murmur2(group_id) & 0x7fffffff) % num_partitions``."""
    return (murmur2(group_id.encode()) & 0x7FFFFFFF) % num_partitions


# -- Kafka security from the environment (as DORA's roles read it) ----------------------------------
def security_config(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """librdkafka settings from ``DORA_KAFKA_SECURITY_PROTOCOL``, ``DORA_KAFKA_SASL_MECHANISM``,
    ``DORA_KAFKA_SASL_USERNAME``, ``DORA_KAFKA_SASL_PASSWORD[_FILE]``, ``DORA_KAFKA_SSL_CA_FILE`` and/or the
    TOML file ``DORA_KAFKA_CLIENT_CONFIG`` (same keys, lower case, without ``DORA_KAFKA_``); the
    environment wins key by key. Nothing set: PLAINTEXT."""
    keys = ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file",
            "ssl_ca_file")
    cfg: dict[str, str] = {}
    if env.get("DORA_KAFKA_CLIENT_CONFIG"):
        path = Path(env["DORA_KAFKA_CLIENT_CONFIG"]).expanduser()
        cfg = {k: str(v) for k, v in tomllib.loads(path.read_text()).items() if k in keys and v}
        for k in ("sasl_password_file", "ssl_ca_file"):
            if k in cfg:
                cfg[k] = str(path.parent / Path(cfg[k]).expanduser())
    given = {k: env.get(f"DORA_KAFKA_{k.upper()}", "") for k in keys}
    if given["sasl_password"] or given["sasl_password_file"]:  # the environment's password wins as a whole
        cfg.pop("sasl_password", None)
        cfg.pop("sasl_password_file", None)
    cfg.update({k: v for k, v in given.items() if v})
    protocol = cfg.get("security_protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return {}
    password = cfg.get("sasl_password") or Path(cfg["sasl_password_file"]).read_text().rstrip("\r\n")
    return {"security.protocol": protocol, "sasl.mechanisms": cfg.get("sasl_mechanism", "SCRAM-SHA-512").upper(),
            "sasl.username": cfg["sasl_username"], "sasl.password": password, "ssl.ca.location": cfg["ssl_ca_file"]}


# -- rewards, in a killable worker -------------------------------------------------------------------
def reverse_reward(reference: str, completion: str) -> float:
    """DORA's ``reverse`` task: 1 for an exact match; 0 if the length is off by more than half the
    reference's; else 0.5 * matching positions / the longer length."""
    if completion == reference:
        return 1.0
    if abs(len(completion) - len(reference)) > 0.5 * len(reference):
        return 0.0
    return 0.5 * sum(a == b for a, b in zip(completion, reference, strict=False)) / max(
        len(reference), len(completion), 1)


def chainsum_reward(reference: str, completion: str) -> float:
    """DORA's ``chainsum`` task: 1 iff the text after the completion's last ``#`` is the reference's."""
    return float("#" in completion and completion.rsplit("#", 1)[-1] == reference.rsplit("#", 1)[-1])


TASK_REWARDS = {"reverse": reverse_reward, "chainsum": chainsum_reward}


def task_reward(task: str, reference: str, completion: str) -> float:
    if task not in TASK_REWARDS:
        raise KeyError(f"no reward for task {task!r}; known: {sorted(TASK_REWARDS)}")
    return TASK_REWARDS[task](reference, completion)


def _orphan_watch(parent: int) -> None:
    """In the worker: exit as soon as the service that started it is gone (even mid-call)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _worker(conn: Any, spec: str, parent: int) -> None:
    """Worker process: says ("ready", None) once the function is loaded, then answers one call at a time
    from ``conn`` with ("ok", reward) or ("error", message)."""
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    fn = task_reward
    if spec != "task":
        path, _, name = spec.rpartition(":")
        mod_spec = importlib.util.spec_from_file_location("user_reward", path)
        assert mod_spec is not None and mod_spec.loader is not None, f"cannot load {path}"
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        fn = getattr(module, name)
    conn.send(("ready", None))
    while True:
        try:
            task, reference, completion = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(task, reference, completion)))
        except Exception as exc:
            conn.send(("error", f"raised {type(exc).__name__}: {exc}"[:1000]))


class RewardWorker:
    """Calls the reward in a spawned worker process, at most ``timeout_s`` per call (then it is killed)."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # never fork a process holding librdkafka threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.spec, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv() != ("ready", None):  # startup is not the call's time
            raise RuntimeError(f"the reward worker did not start (reward function {self.spec!r})")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()
        self.proc = self.conn = None

    def score(self, task: str, reference: str, completion: str) -> float | str:
        """A reward in [0, 1], or the reason (str) this try failed."""
        if self.proc is None:
            self._start()
        try:
            self.conn.send((task, reference, completion))
            if not self.conn.poll(self.timeout_s):
                self.close()
                return f"timeout after {self.timeout_s}s"
            kind, value = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.close()
            return "crashed: the reward worker died"
        if kind != "ok":
            return str(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not 0.0 <= value <= 1.0:
            return f"invalid reward {value!r} (need a finite number in [0, 1])"
        return float(value)


# -- the service --------------------------------------------------------------------------------------
def _run_record(wire: Wire, msg: Any) -> dict[str, Any] | None:
    """A record of ``dora.runs`` decoded, or None for one that is not a run record (passed over: anyone may
    write bytes to a topic, and the compacted log keeps them)."""
    try:
        return wire.decode("RunInfo", msg.value(), msg.headers())
    except ValueError as exc:
        log.warning("passing over an undecodable record at %s[%s]@%s: %s", msg.topic(), msg.partition(),
                    msg.offset(), exc)
        return None


def find_run(wire: Wire, base: dict[str, Any], run_id: str, wait_s: float) -> tuple[dict[str, Any], int]:
    """The run's latest record on ``dora.runs`` (compacted, one partition) and the end offset read."""
    consumer = Consumer({**base, "group.id": "dora-reader-reward-service", "enable.auto.commit": False})
    deadline, tp = time.monotonic() + wait_s, TopicPartition(RUNS, 0)
    try:
        while True:
            low, high = consumer.get_watermark_offsets(tp, timeout=15)
            found: dict[str, Any] | None = None
            consumer.assign([TopicPartition(RUNS, 0, low)])
            position, idle_until = low, time.monotonic() + 10
            while position < high and time.monotonic() < idle_until:
                for msg in consumer.consume(500, 0.5):
                    if msg.error() is None:
                        position, idle_until = (msg.offset() or 0) + 1, time.monotonic() + 10
                        info = _run_record(wire, msg)
                        if info is not None and info["run_id"] == run_id and info["start_offsets"]:
                            found = info
            if found is not None:
                return found, high
            if time.monotonic() > deadline:
                raise SystemExit(f"run {run_id} is not recorded on {RUNS} (waited {wait_s:.0f}s)")
            time.sleep(1.0)
    finally:
        consumer.close()


class RewardService:
    """Consume-score-produce for one run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, security: dict[str, Any]) -> None:
        self.args, self.wire = args, Wire(Path(args.schemas))
        self.scorer_key, self.token = _secret(args.scorer_key_file), _secret(args.token_file)
        base = {"bootstrap.servers": args.bootstrap_servers, **security}
        self.info, runs_end = find_run(self.wire, base, args.run_id, args.wait_run_s)
        self.num_partitions = int(json.loads(self.info["config_json"]).get("num_partitions", 4))
        self.start = {(o["topic"], o["partition"]): o["offset"] for o in self.info["start_offsets"]}
        name = f"dora.{args.run_id}.{COMPONENT}"
        self.producer = Producer({**base, "transactional.id": f"{name}.{args.instance}", "enable.idempotence": True,
                                  "acks": "all", "linger.ms": 5, "message.max.bytes": 64 << 20})
        self.producer.init_transactions(60)  # first: aborts (and fences) a predecessor's open transaction
        self.consumer = Consumer({**base, "group.id": name, "group.instance.id": f"{COMPONENT}-{args.instance}",
                                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                                  "isolation.level": "read_committed", "session.timeout.ms": 10000,
                                  "max.poll.interval.ms": 600000, "fetch.max.bytes": 64 << 20,
                                  "max.partition.fetch.bytes": 64 << 20})
        self.consumer.subscribe([self.topic(TRAJECTORIES)], on_assign=self._on_assign)
        self.runs = Consumer({**base, "group.id": "dora-reader-reward-service", "enable.auto.commit": False})
        self.runs.assign([TopicPartition(RUNS, 0, runs_end)])
        self.worker = RewardWorker(args.reward_fn, args.timeout_s)
        self.scored = self.refused = 0
        self.stopping = self.info["state"] != "STARTED"  # a run already over needs no scorer

    def topic(self, name: str) -> str:
        """The run's own topic ``dora.<run_id>.<name>``."""
        return f"dora.{self.args.run_id}.{name}"

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Resume from the group's committed offsets, else from where the run began."""
        committed = consumer.committed(partitions, timeout=30)
        for tp in committed:
            if tp.offset == OFFSET_INVALID or tp.offset < 0:
                tp.offset = self.start.get((tp.topic, tp.partition), 0)
        consumer.assign(committed)

    def _run_over(self) -> bool:
        for msg in self.runs.consume(100, 0):
            if msg.error() is None:
                info = _run_record(self.wire, msg)
                if info is not None and info["run_id"] == self.args.run_id and info["state"] in ("FINISHED", "FAILED"):
                    log.info("run %s is %s: exiting", self.args.run_id, info["state"])
                    return True
        return False

    def _letter(self, msg: Any, reason: str, error_type: str, traj: dict[str, Any] | None, tries: int) -> Any:
        letter = {"run_id": traj["run_id"] if traj else self.args.run_id, "component": COMPONENT,
                  "reason": reason[:2000], "error_type": error_type, "source_topic": f"dora.{TRAJECTORIES}",
                  "source_partition": msg.partition(), "source_offset": msg.offset(), "key": msg.key(),
                  "value": msg.value(), "ts_ms": int(time.time() * 1000), "attempts": tries,
                  "group_id": traj["group_id"] if traj else None,
                  "trajectory_id": traj["trajectory_id"] if traj else None}
        key = msg.key() or f"{msg.topic()}/{msg.partition()}/{msg.offset()}".encode()
        return (self.topic(DLQ), key, *self.wire.encode("DeadLetter", letter, self.token), None)

    def _generated_by_the_run(self, traj: dict[str, Any]) -> bool:
        """The trajectory carries the signature of an instance of the run (its weight token)."""
        body = self.wire.encode("Trajectory", {**traj, "signature": None})[0]
        expected = hmac.new(self.token.encode(), body, hashlib.sha256).hexdigest()
        return bool(traj.get("signature")) and hmac.compare_digest(str(traj["signature"]), expected)

    def _score_batch(self, msgs: list[Any]) -> tuple[list[Any], dict[tuple[str, int], int]]:
        """Outputs for a prefix of ``msgs`` scored within the budget; the first offset left per partition."""
        outs: list[Any] = []
        rewind: dict[tuple[str, int], int] = {}
        t0 = time.monotonic()
        for msg in msgs:
            tp = (msg.topic(), msg.partition())
            if tp in rewind or time.monotonic() - t0 > self.args.batch_budget_s:
                rewind.setdefault(tp, msg.offset())
                continue
            try:
                traj = self.wire.decode("Trajectory", msg.value(), msg.headers())
            except ValueError as exc:
                outs.append(self._letter(msg, str(exc), "decode", None, 0))
                continue
            if traj["run_id"] != self.args.run_id:
                continue
            if self.token and not self._generated_by_the_run(traj):  # DORA's own scorer refuses it too
                outs.append(self._letter(msg, f"trajectory {traj['trajectory_id']} is not signed with the run's "
                                              "token", "signature", None, 0))
                continue
            outcome: float | str = "not tried"
            for _ in range(self.args.max_attempts):
                outcome = self.worker.score(traj["task"], traj["reference"], traj["response_text"])
                if isinstance(outcome, float):
                    break
            if isinstance(outcome, float):
                traj.update(reward=outcome, scored_ms=int(time.time() * 1000))
                key = f"v{int(traj['policy_version']):010d}/{traj['group_id']}".encode()
                outs.append((self.topic(SCORED), key, *self.wire.encode("Trajectory", traj, self.scorer_key),
                             partition_for(traj["group_id"], self.num_partitions)))
                self.scored += 1
            else:
                reason = (f"no reward after {self.args.max_attempts} tries: trajectory {traj['trajectory_id']} "
                          f"(task {traj['task']}): {outcome}")
                outs.append(self._letter(msg, reason, "reward", traj, self.args.max_attempts))
                self.refused += 1
                log.warning("refused %s: %s", traj["trajectory_id"], reason)
        for name, value in (("scored_total", self.scored), ("reward_errors_total", self.refused),
                            ("score_s", time.monotonic() - t0)):
            metric = {"run_id": self.args.run_id, "component": COMPONENT, "name": name, "value": float(value),
                      "ts_ms": int(time.time() * 1000)}
            outs.append((self.topic(METRICS), f"{COMPONENT}/{name}".encode(), *self.wire.encode("Metric", metric),
                         None))
        return outs, rewind

    def _commit(self, outs: list[Any], rewind: dict[tuple[str, int], int]) -> None:
        """Outputs + consumed offsets in one transaction; on an abortable error, read the batch again."""
        positions = [tp for tp in self.consumer.position(self.consumer.assignment()) if tp.offset >= 0]
        for tp in positions:
            tp.offset = rewind.get((tp.topic, tp.partition), tp.offset)
        try:
            self.producer.begin_transaction()
            for topic, key, value, headers, partition in outs:
                extra = {} if partition is None else {"partition": partition}
                self.producer.produce(topic, value=value, key=key, headers=headers, **extra)
            self.producer.send_offsets_to_transaction(positions, self.consumer.consumer_group_metadata(), 60)
            self.producer.commit_transaction(60)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.fatal() or not err.txn_requires_abort():
                raise  # fenced by a newer incarnation, or worse: exit, the restart resumes
            log.warning("transaction aborted (%s): reading the batch again", err)
            self.producer.abort_transaction(60)
            positions = self.consumer.committed(self.consumer.assignment(), timeout=30)
            rewind = {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else self.start.get(
                (tp.topic, tp.partition), 0) for tp in positions}
        for (topic, partition), offset in rewind.items():
            self.consumer.seek(TopicPartition(topic, partition, offset))

    def run(self) -> None:
        log.info("scoring run %s (%d partitions) as %s", self.args.run_id, self.num_partitions, self.args.instance)
        try:
            while not self.stopping and not self._run_over():
                msgs = []
                for msg in self.consumer.consume(self.args.batch, 0.5):
                    if msg.error() is None:
                        msgs.append(msg)
                    elif msg.error().fatal():
                        raise KafkaException(msg.error())
                    else:
                        log.warning("consumer: %s", msg.error())
                if msgs:
                    self._commit(*self._score_batch(msgs))
        finally:
            self.worker.close()
            self.consumer.close()
            self.runs.close()
        log.info("stopped: %d scored, %d refused by this incarnation", self.scored, self.refused)


def default_schemas() -> str:
    """``dora_rl/schemas`` under the working directory, else beside this file's repository."""
    here = Path("dora_rl/schemas")
    return str(here if here.is_dir() else Path(__file__).resolve().parent.parent / "dora_rl" / "schemas")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Kafka security: " + " ".join(security_config.__doc__.split()))
    p.add_argument("--bootstrap-servers", default=os.environ.get("DORA_BOOTSTRAP_SERVERS", "localhost:9092"))
    p.add_argument("--run-id", required=True)
    p.add_argument("--schemas", default=default_schemas(), help="directory of the .avsc files")
    p.add_argument("--reward-fn", default="task", help="'task' or FILE.py:FUNCTION")
    p.add_argument("--timeout-s", type=float, default=10.0, help="limit of one reward call")
    p.add_argument("--max-attempts", type=int, default=2, help="tries of one trajectory before it is refused")
    p.add_argument("--batch", type=int, default=200, help="records per poll (one transaction)")
    p.add_argument("--batch-budget-s", type=float, default=30.0, help="scoring time per transaction")
    p.add_argument("--instance", default="0", help="replica name: transactional.id and group.instance.id")
    p.add_argument("--wait-run-s", type=float, default=60.0, help="wait this long for the run to be recorded")
    p.add_argument("--scorer-key-file", default=os.environ.get("DORA_SCORER_KEY_FILE", ""),
                   help="the run's <run dir>/scorer-key: scores are signed with it (DORA trains no other)")
    p.add_argument("--token-file", default=os.environ.get("DORA_WEIGHT_TOKEN_FILE", ""),
                   help="the run's <run dir>/weight-token: refusals are signed with it (DORA withdraws on no other)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    service = RewardService(args, security_config())

    def on_signal(signum: int, frame: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
