"""The topic catalogue: the one place every fact about a Kafka topic is declared, and its creation.

Each :class:`TopicSpec` declares, once: name, record schema, writers and readers, key format,
partitioning rule, partition count, retention, cleanup policy, message-size limit and purpose.
``docs/topics.md`` and the topic table of ``README.md`` are generated from it
(``dora-rl topics doc``; :mod:`dora_rl.infra.kafka.topic_docs`), and a unit test fails when they drift
from it or when a declared writer/reader no longer references the topic in its code.

Invariants (checked when a spec is built):

- every writer and reader names an :class:`Actor` of :data:`ACTORS` (a role or a tool);
- the partition count follows the rule: ``group_id`` topics have ``num_partitions``, the request
  topic has one partition per instance index that may serve (``max_instances``, at least
  :data:`MAX_INSTANCES`; partition = instance index), ``single`` topics have one;
- a compacted topic declares no time retention (the latest record per key is kept);
- ``configs`` (what :func:`ensure_topics` applies) is derived from the typed fields, never stated apart.

Every topic but :data:`GLOBAL_TOPICS` exists once per run, as ``dora.<run_id>.<name>`` (:func:`in_run`,
decision 0063). Creating and deleting topics on a cluster: :mod:`dora_rl.infra.kafka.topic_admin`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

DAY_MS = 24 * 3600 * 1000
MIB = 1024 * 1024
MAX_INSTANCES = 16
"""Partitions of ``dora.rollout.requests``: one per rollout instance index, so at most 16 instances."""

BATCH_MAX_BYTES = 64 * MIB
"""Largest record (inline training batches, docs/decisions/0005); also the clients' fetch/produce limit."""

PROMPTS = "dora.prompts"
REQUESTS = "dora.rollout.requests"
TOKENS = "dora.rollout.tokens"
TRAJECTORIES = "dora.rollout.trajectories"
SCORED = "dora.rollout.scored"
INSTANCES = "dora.instances"
VERSIONS = "dora.policy.versions"
HOLDERS = "dora.policy.holders"
BATCHES = "dora.train.batches"
DLQ = "dora.dlq"
METRICS = "dora.metrics"
RUNS = "dora.runs"
SCHEDULE = "dora.schedule"
STATE = "dora.state"

GLOBAL_TOPICS = frozenset({RUNS})
"""Topics shared by every run (the run registry); every other catalogue topic exists once per run."""

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,100}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name Kafka resources unambiguously: 1-100 of ``[A-Za-z0-9_-]`` (no dot, so the
    prefix ``dora.<run_id>.`` of one run is never a prefix of another's); ValueError otherwise."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r}: use 1-100 letters, digits, '-' or '_'")
    return run_id


@functools.cache
def in_run(run_id: str, name: str) -> str:
    """The topic that holds catalogue topic ``name`` for run ``run_id``: ``dora.<run_id>.<name without
    'dora.'>`` (e.g. ``dora.r1.train.batches``), so a run's topics, consumer groups and transactional ids
    share the prefix ``dora.<run_id>.`` (decision 0063); :data:`GLOBAL_TOPICS` keep their name."""
    if name in GLOBAL_TOPICS:
        return name
    if not name.startswith("dora."):
        raise ValueError(f"{name!r} is not a catalogue topic name")
    return f"dora.{check_run_id(run_id)}.{name[len('dora.'):]}"


def catalogue_name(run_id: str, topic: str) -> str:
    """The inverse of :func:`in_run`: the catalogue name of ``topic`` of run ``run_id`` (ValueError for a
    topic of no run or of another run)."""
    if topic in GLOBAL_TOPICS:
        return topic
    prefix = f"dora.{run_id}."
    if not topic.startswith(prefix):
        raise ValueError(f"topic {topic!r} is not a topic of run {run_id!r}")
    return "dora." + topic[len(prefix):]


Partitioning = Literal["group_id", "instance", "single"]
Cleanup = Literal["delete", "compact"]

PARTITIONING_RULES: dict[str, str] = {
    "group_id": "the producer picks `(murmur2(group_id) & 0x7fffffff) % num_partitions` (`infra/kafka/keys.py`), "
                "so a group stays on one partition across versions",
    "instance": "the orchestrator sets partition = the target rollout instance's index",
    "single": "one partition: a total order",
}
"""How a producer picks the partition, per :data:`Partitioning` value."""


@dataclass(frozen=True)
class Actor:
    """A process that reads or writes topics: a role of a run or a tool.

    ``modules`` are the repository-relative source files that hold its Kafka reads and writes (the
    drift test checks that each declared topic is referenced there).
    """

    name: str
    kind: Literal["role", "tool"]
    command: str
    modules: tuple[str, ...]
    summary: str


_ROLE_ENTRY = "dora_rl/roles.py"  # every role reads its run from dora.runs here

ACTORS: dict[str, Actor] = {a.name: a for a in (
    Actor("dataset", "role", "dora-rl dataset", ("producers/dataset.py", _ROLE_ENTRY), "writes a run's prompts"),
    Actor("orchestrator", "role", "dora-rl orchestrator",
          ("streams/orchestrator.py", "streams/kafka_runtime.py", "infra/kafka/snapshots.py", _ROLE_ENTRY),
          "dispatches version-tagged requests, migrates trajectories, plans every batch"),
    Actor("rollout", "role", "dora-rl rollout --index i",
          ("producers/rollout/worker.py", "producers/rollout/requests.py", "producers/rollout/poison.py",
           "producers/rollout/identity.py", "producers/rollout/instance_processor.py",
           "infra/kafka/snapshots.py", _ROLE_ENTRY),
          "a rollout instance: holds one policy version, generates what it is asked"),
    Actor("scorer", "role", "dora-rl scorer",
          ("streams/reward_scorer.py", "streams/kafka_runtime.py", "infra/kafka/snapshots.py", _ROLE_ENTRY),
          "scores trajectories (Kafka transactions: exactly-once)"),
    Actor("assembler", "role", "dora-rl assembler",
          ("streams/assembler.py", "streams/kafka_runtime.py", "infra/kafka/snapshots.py", _ROLE_ENTRY),
          "materialises planned batches, staleness gate (transactions: exactly one batch per step)"),
    Actor("trainer", "role", "dora-rl trainer", ("consumers/trainer/role.py", _ROLE_ENTRY),
          "trains each batch, announces each new version"),
    Actor("run", "tool", "dora-rl run", ("dora_rl/launcher.py", "dora_rl/run_progress.py", "infra/kafka/runs.py",
                                          "consumers/dashboard/plot.py"),
          "records the run, launches the roles, follows progress"),
    Actor("monitor", "tool", "dora-rl monitor", ("consumers/monitor.py", "consumers/monitor_feed.py",
                                                 "consumers/monitor_view.py"),
          "live view: versions, instances, staleness, lag, dead letters, throughput, reward"),
    Actor("dashboard", "tool", "dora-rl dashboard", ("consumers/dashboard/server.py", "consumers/monitor_feed.py",
                                                     "consumers/monitor_view.py"),
          "web page of a run: curves and a version timeline per instance (docs/decisions/0021)"),
    Actor("audit", "tool", "dora-rl audit", ("consumers/audit.py",), "checks C1-C3 and TBS from the topics"),
    Actor("replay", "tool", "dora-rl replay",
          ("consumers/replay/dump.py", "consumers/replay/source.py", "consumers/replay/archive.py",
           "consumers/replay/retrain.py", "consumers/replay/rescore.py", "consumers/replay/refeed.py",
           "consumers/replay/export.py"),
          "re-runs a recorded run: records as JSON lines (any topic via --topic), retrain, rescore, refeed, "
          "export, archive (docs/decisions/0020)"),
    Actor("runs", "tool", "dora-rl runs", ("infra/kafka/runs.py",), "lists the runs recorded on the cluster"),
    Actor("bench", "tool", "make bench-modes, bench/chaos.py, bench/kill_run.py, bench/real_modes.py",
          ("bench/modes.py", "bench/chaos.py", "bench/kill_run.py", "bench/real_modes.py"),
          "reads runs' figures back (chaos: kill times against each role's first new output)"),
    Actor("bench-snapshot", "tool", "bench/orchestrator_snapshot.py", ("bench/orchestrator_snapshot.py",),
          "writes a dataset of prompts and reads the orchestrator's snapshot back, on a broker of its own (not an "
          "operator: no ACL is derived for it)"),
    Actor("bench-pipeline", "tool", "bench/pipeline.py", ("bench/pipeline.py",),
          "plays the rollout instances and the orchestrator's plans to time the real scorer and assembler, on "
          "a broker of its own (not an operator: no ACL is derived for it)"),
    Actor("bench-latency", "tool", "bench/dispatch_latency.py", ("bench/dispatch_latency.py",),
          "reads runs' requests, plans, versions, trajectories and the orchestrator's snapshots back to time how "
          "long a decision waits for its reader, on a broker of its own (not an operator: no ACL is derived for it)"),
)}
"""Every role and tool named as a writer or reader, by name."""

ROLE_NAMES: tuple[str, ...] = tuple(a.name for a in ACTORS.values() if a.kind == "role")


@dataclass(frozen=True)
class TopicSpec:
    """Every fact about one topic (see the module docstring for the invariants)."""

    name: str
    partitions: int
    schema: str
    """Avro full name of the record (key of ``dora_rl.schemas.records.RECORDS``)."""
    doc: str
    """One-line purpose."""
    writers: tuple[str, ...]
    readers: tuple[str, ...]
    key: str
    """Key format (infra/kafka/keys.py); ``<...>`` are placeholders."""
    partitioning: Partitioning
    retention_ms: int | None
    """``retention.ms``; None: none set (compacted, or the broker default)."""
    cleanup: Cleanup = "delete"
    max_message_bytes: int | None = None
    """``max.message.bytes``; None: the broker's ``message.max.bytes``."""
    notes: str = ""
    """Facts worth a sentence in docs/topics.md (who reads what for which reason)."""

    def __post_init__(self) -> None:
        unknown = [a for a in self.writers + self.readers if a not in ACTORS]
        if unknown or not self.writers:
            raise ValueError(f"{self.name}: writers must be non-empty and name known actors, unknown: {unknown}")
        want = {"instance": max(MAX_INSTANCES, self.partitions), "single": 1}.get(self.partitioning, self.partitions)
        if self.partitions < 1 or self.partitions != want:
            raise ValueError(f"{self.name}: {self.partitions} partitions contradict partitioning "
                             f"{self.partitioning!r}")
        if self.cleanup == "compact" and self.retention_ms is not None:
            raise ValueError(f"{self.name}: a compacted topic declares no retention.ms")

    @property
    def record(self) -> str:
        """Record class name in ``dora_rl.schemas.records`` (the Avro name without its namespace)."""
        return self.schema.rsplit(".", 1)[-1]

    @property
    def purpose(self) -> str:
        """The one-line purpose (alias of ``doc``)."""
        return self.doc

    @property
    def configs(self) -> dict[str, str]:
        """Topic configs applied at creation, derived from the typed fields."""
        out: dict[str, str] = {}
        if self.retention_ms is not None:
            out["retention.ms"] = str(self.retention_ms)
        if self.cleanup != "delete":
            out["cleanup.policy"] = self.cleanup
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        return out




def catalogue(num_partitions: int = 4, instances: int = MAX_INSTANCES) -> tuple[TopicSpec, ...]:
    """Every topic of the system. ``num_partitions`` spreads the ``group_id``-partitioned topics;
    ``instances`` (a run's ``max_instances``) sizes the request topic: one partition per rollout
    instance index that may ever serve, at least :data:`MAX_INSTANCES`."""
    week, day, month = 7 * DAY_MS, DAY_MS, 30 * DAY_MS
    replay = ("Kept 30 d (not 7) for `dora-rl replay` (docs/decisions/0020): ")
    group = "v<policy_version:010d>/<group_id>"
    return (
        TopicSpec(PROMPTS, 1, "dora.v1.Prompt", "dataset prompts of a run, before dispatch, in dataset order",
                  writers=("dataset", "bench-snapshot"), readers=("orchestrator", "replay"),
                  key="v-/<group_id>", partitioning="single", retention_ms=week,
                  notes="No version exists before dispatch, hence `v-` in the key. One partition, so the "
                        "orchestrator sees (and dispatches, FIFO) the prompts in dataset order p0, p1, ...: "
                        "a run's prompt-to-step assignment is reproducible (docs/decisions/0016). Clusters "
                        "created before this hold more partitions; only partition 0 is written."),
        TopicSpec(REQUESTS, max(MAX_INSTANCES, instances), "dora.v1.RolloutRequest",
                  "version-tagged GENERATE / CANCEL requests, one partition per rollout instance",
                  writers=("orchestrator",),
                  readers=("rollout", "orchestrator", "audit", "replay", "monitor", "dashboard", "bench-latency"),
                  key=group, partitioning="instance", retention_ms=week,
                  notes="Each instance reads only its own partition (no group rebalancing). The orchestrator "
                        "re-reads its own past requests on start so a prompt is never dispatched twice; the "
                        "audit checks C1/C2 against them. A request with partial tokens is a migration; its `kv`, "
                        "when set, names where the trajectory's KV rows wait (the exporting instance's weight "
                        "holder, decision 0065): the instance fetches them only through a reference signed with "
                        "the run's token, checks them against the record's checksums, and otherwise prefills, "
                        "counting why (`kv_fallback` on `dora.metrics`)."),
        TopicSpec(TOKENS, num_partitions, "dora.v1.TokenChunk",
                  "token chunks as they are decoded; the aborted partial response of a migrating trajectory",
                  writers=("rollout",), readers=("orchestrator", "audit", "replay"),
                  key=group, partitioning="group_id", retention_ms=day,
                  notes="The orchestrator subscribes only in `dora` and `partial` mode, and uses only chunks "
                        "with `aborted = true` (migration hand-off), and only those signed with the run's "
                        "token (a forged one is dead-lettered); it copies an aborted chunk's `kv` (set when "
                        "the engine exported the trajectory's KV rows: torch, emulated) into the resume request "
                        "when the resume runs under the chunk's version. The audit checks every chunk's version "
                        "against its trajectory's (C1). No monitor reads this topic today."),
        TopicSpec(TRAJECTORIES, num_partitions, "dora.v1.Trajectory",
                  "completed trajectories (reward null), in completion order",
                  writers=("rollout", "bench-pipeline"),
                  readers=("scorer", "orchestrator", "audit", "replay", "monitor", "dashboard", "bench-latency"),
                  key=group, partitioning="group_id", retention_ms=week, max_message_bytes=8 * MIB,
                  notes="The orchestrator reads completions (instance load, batch planning); the key's "
                        "version is the request's."),
        TopicSpec(SCORED, num_partitions, "dora.v1.Trajectory", "trajectories with their reward",
                  writers=("scorer",), readers=("assembler", "orchestrator", "replay", "bench", "bench-pipeline"),
                  key=group, partitioning="group_id", retention_ms=month, max_message_bytes=8 * MIB,
                  notes="Written in Kafka transactions (consumed offsets included): exactly-once from "
                        "`dora.rollout.trajectories`. Default topic of `dora-rl replay`. " + replay
                        + "`rescore`, `refeed --source scored` and `export` read every scored trajectory here "
                        "(`dora.rollout.trajectories` holds the same responses without their reward, so it "
                        "keeps 7 d)."),
        TopicSpec(INSTANCES, 1, "dora.v1.InstanceStatus",
                  "rollout instance heartbeats: loaded version, state, in-flight, busy time",
                  writers=("rollout",),
                  readers=("orchestrator", "rollout", "run", "monitor", "dashboard", "audit", "replay", "bench"),
                  key="v<loaded_version:010d>/<instance_id>", partitioning="single",
                  retention_ms=day,
                  notes="The key holds version 0 before the first load. Not compacted, on purpose: the "
                        "heartbeat history is the per-instance timeline (versions held over time; busy time "
                        "read back by `bench/modes.py`); compaction would keep only the last heartbeat per "
                        "(version, instance). The orchestrator reads it in `dora`/`partial` mode for liveness only: an "
                        "instance silent for `instance_timeout_s` is lost and its in-flight work generated "
                        "again elsewhere; a new index joins (streams/membership.py)."),
        TopicSpec(VERSIONS, 1, "dora.v1.PolicyVersion",
                  "policy version announcements (weights move out of band), in one order",
                  writers=("trainer",),
                  readers=("orchestrator", "rollout", "trainer", "audit", "replay", "bench", "monitor", "dashboard",
                           "bench-latency"),
                  key="v<version:010d>/policy", partitioning="single", retention_ms=month,
                  max_message_bytes=8 * MIB,
                  notes="Only the trainer announces here (`announced_by = TRAINER`), so on a secured cluster no "
                        "other principal can announce a version (decision 0057); extra holders go to "
                        "`dora.policy.holders`. " + replay + "`retrain` compares a re-trained step's "
                        "weights with the announced checksums of the version it produced, and its loss and "
                        "gradient norm with the announced train metrics."),
        TopicSpec(HOLDERS, 1, "dora.v1.PolicyVersion",
                  "extra holders of announced versions (peer-to-peer weight fan-out)",
                  writers=("rollout", "trainer"), readers=("rollout", "audit", "replay", "bench"),
                  key="v<version:010d>/policy", partitioning="single", retention_ms=month,
                  max_message_bytes=8 * MIB,
                  notes="With the torch engine over ucx/tcp, an instance that loaded a version re-announces it "
                        "here naming itself as a holder (`announced_by = HOLDER`); a restarted trainer re-announces "
                        "its live versions here. Readers take only the holder addresses, for versions the trainer "
                        "announced on `dora.policy.versions`: the weights' checksums come from there."),
        TopicSpec(BATCHES, 1, "dora.v1.TrainBatch", "training batches, exactly TBS trajectories inline",
                  writers=("assembler", "replay"),
                  readers=("trainer", "orchestrator", "audit", "replay", "bench", "bench-pipeline", "monitor",
                           "dashboard"),
                  key="v<train_step:010d>/step<train_step>", partitioning="single",
                  retention_ms=month, max_message_bytes=BATCH_MAX_BYTES,
                  notes="The key's version is the base version (= train step). The orchestrator reads "
                        "consumption. Each batch commits in one transaction with the assembler's snapshot, so "
                        "there is exactly one committed batch per step. `dora-rl replay refeed` writes a new "
                        "run's batches from a recorded run's (each with its `provenance`), in one transaction. "
                        + replay + "a batch is the whole input of a step, so `retrain` re-executes a step from "
                        "it and a checkpoint, and `refeed` trains a new run on it; past retention, "
                        "`dora-rl replay archive` keeps a run."),
        TopicSpec(DLQ, 1, "dora.v1.DeadLetter", "every refused record, with the reason and the original bytes",
                  writers=("dataset", "orchestrator", "rollout", "scorer", "assembler", "trainer", "monitor", "run"),
                  readers=("orchestrator", "monitor", "dashboard", "audit", "replay"),
                  key="<refused record's key> or <topic>/<partition>/<offset>",
                  partitioning="single", retention_ms=30 * DAY_MS, max_message_bytes=BATCH_MAX_BYTES,
                  notes="Any consumer built on `RunConsumer` dead-letters what it cannot decode (so the "
                        "monitor and `dora-rl run` may write here too); the dataset refuses an oversize prompt. "
                        "A letter naming a `group_id` refuses that whole GRPO group: the orchestrator withdraws "
                        "it and dispatches a replacement prompt."),
        TopicSpec(METRICS, 1, "dora.v1.Metric", "numeric monitoring events",
                  writers=("orchestrator", "rollout", "scorer", "assembler", "trainer"),
                  readers=("run", "monitor", "dashboard", "replay", "bench"),
                  key="<component>/<name>", partitioning="single", retention_ms=week,
                  notes="The key carries no version (an exception to docs/decisions/0002)."),
        TopicSpec(SCHEDULE, 1, "dora.v1.BatchPlan",
                  "batch plans: which trajectories form each step's batch (earliest deadline first)",
                  writers=("orchestrator", "bench-pipeline"), readers=("assembler", "replay", "bench-latency"),
                  key="v<train_step:010d>/plan", partitioning="single", retention_ms=week,
                  notes="One writer decides both dispatch and batch membership (docs/decisions/0006)."),
        TopicSpec(STATE, 1, "dora.v1.ProcessorSnapshot",
                  "roles' state: a stream processor's snapshot per commit, a rollout instance's tries",
                  writers=("orchestrator", "assembler", "scorer", "rollout"),
                  readers=("orchestrator", "assembler", "scorer", "rollout", "bench", "bench-snapshot",
                           "bench-latency"),
                  key="<run_id>/<processor>", partitioning="single", retention_ms=None, cleanup="compact",
                  max_message_bytes=BATCH_MAX_BYTES,
                  notes="A processor's snapshot is written with its outputs and consumed offsets in one "
                        "transaction (streams/kafka_runtime.py); a rollout instance's poison-input tries "
                        "(key `<run_id>/rollout-<i>.attempts`) are flushed before each engine call "
                        "(producers/rollout/poison.py). A restarted role reads its latest record backwards "
                        "from the end (infra/kafka/snapshots.py, docs/decisions/0015)."),
        TopicSpec(RUNS, 1, "dora.v1.RunInfo", "run lifecycle: config, start offsets, state, summary",
                  writers=("run", "trainer", "replay"),
                  readers=(*ROLE_NAMES, "monitor", "dashboard", "audit", "replay", "runs", "bench"),
                  key="run/<run_id>", partitioning="single", retention_ms=None, cleanup="compact",
                  max_message_bytes=8 * MIB,
                  notes="Compacted by run id: the latest record of each run is kept. Every role, tool and "
                        "consumer group starts a run's topics at the end offsets recorded here."),
    )


BROKER_DEFAULT_MAX_BYTES = 1024 * 1024
"""Kafka's default ``message.max.bytes`` (1 MiB + 12 bytes of overhead, rounded down): the limit of a
topic whose spec sets no ``max_message_bytes``."""


@functools.cache
def max_record_bytes(name: str) -> int:
    """The largest record (key + value, before compression) that ``name`` accepts; producers check it
    before sending (:class:`dora_rl.infra.kafka.io.RecordTooLarge`), so an oversize record is refused
    with a reason instead of failing a whole flush or transaction. Cached: it is asked on every send,
    and the catalogue is fixed."""
    try:
        limit = _spec_of(name).max_message_bytes
    except (KeyError, ValueError):
        return BROKER_DEFAULT_MAX_BYTES
    return limit if limit is not None else BROKER_DEFAULT_MAX_BYTES


def _spec_of(name: str) -> TopicSpec:
    """The catalogue entry of a catalogue name or of a run's topic."""
    try:
        return spec(name)
    except KeyError:
        return spec(catalogue_name_of(name))


def catalogue_name_of(topic: str) -> str:
    """The catalogue name of a topic of any run (``dora.<run>.<rest>`` -> ``dora.<rest>``; run ids hold no
    dot); ValueError for a name of no run."""
    if topic in GLOBAL_TOPICS:
        return topic
    parts = topic.split(".", 2)
    if len(parts) != 3 or parts[0] != "dora":
        raise ValueError(f"{topic!r} is not a DORA topic")
    return f"dora.{parts[2]}"


def spec(name: str, num_partitions: int = 4, instances: int = MAX_INSTANCES) -> TopicSpec:
    """The catalogue entry of topic ``name``."""
    for s in catalogue(num_partitions, instances):
        if s.name == name:
            return s
    raise KeyError(f"unknown topic {name!r}")
