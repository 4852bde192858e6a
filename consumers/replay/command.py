"""The ``dora-rl replay <verb>`` command line: arguments of every verb, and the dispatch to them.

``dora-rl replay [dump] ...`` keeps today's behaviour (JSON lines of one topic). Every verb takes
``--run ID`` (default: the latest run) and ``--from-archive DIR`` (read an archive instead of the
topics: no broker needed, except for ``refeed``, which writes a new run). Options given before the
verb belong to ``dump``; verbs' own options never reset them (their defaults are suppressed).
Exit status: 0; 1 when ``retrain`` finds an unedited step whose weights differ from the original's.
Importing this module is cheap (argparse only): the verbs are imported when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

VERBS = ("dump", "retrain", "rescore", "refeed", "export", "archive")
SCORED = "dora.rollout.scored"


def _shared(p: argparse.ArgumentParser, suppress: bool) -> None:
    default: Any = argparse.SUPPRESS if suppress else None
    p.add_argument("--run", default=default, help="run id (default: the latest run)")
    p.add_argument("--from-archive", default=default, metavar="DIR", help="read this run archive instead of Kafka")
    if suppress:
        p.add_argument("--bootstrap-servers", default=default, help="Kafka bootstrap servers")


def _range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}")
    return float(lo) if lo else float("-inf"), float(hi) if hi else float("inf")


def _reward(text: str) -> tuple[str, float]:
    tid, sep, value = text.rpartition("=")
    if not sep or not tid:
        raise argparse.ArgumentTypeError(f"expected TRAJECTORY_ID=REWARD, got {text!r}")
    return tid, float(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``replay`` parser's options (``dump``'s, for ``dora-rl replay`` without a verb) and verbs."""
    _shared(p, suppress=False)
    p.add_argument("--topic", default=SCORED, help="dump: the topic to decode")
    p.add_argument("--version", type=int, default=None, help="dump: only this key version")
    p.add_argument("--group", default=None, help="dump: only this group id")
    p.add_argument("--out", default=None, help="dump: write here instead of stdout")
    verbs = p.add_subparsers(dest="verb", metavar="{" + ",".join(VERBS) + "}")
    d = verbs.add_parser("dump", help="records as JSON lines (the default verb)")
    _shared(d, suppress=True)
    for flag, kw in (("--topic", {}), ("--version", {"type": int}), ("--group", {}), ("--out", {})):
        d.add_argument(flag, default=argparse.SUPPRESS, **kw)  # type: ignore[arg-type]
    r = verbs.add_parser("retrain", help="re-execute a recorded train step and compare with the original")
    _shared(r, suppress=True)
    r.add_argument("--step", type=int, required=True, help="train step k (the update from version k to k+1)")
    r.add_argument("--set-reward", type=_reward, action="append", default=[], metavar="ID=R",
                   help="what-if: train step k with this trajectory's reward replaced (repeatable)")
    r.add_argument("--json", default=None, help="write the report here")
    s = verbs.add_parser("rescore", help="recorded trajectories through a reward function, diff per group")
    _shared(s, suppress=True)
    s.add_argument("--reward-fn", default=None, help="'task' or 'module:function' (default: the run's)")
    s.add_argument("--topic", dest="rescore_topic", default=SCORED, help="dora.rollout.scored or .trajectories")
    s.add_argument("--version", dest="rescore_version", type=int, default=None, help="only this policy version")
    s.add_argument("--group", dest="rescore_group", default=None, help="only this group id")
    s.add_argument("--json", default=None, help="write the full diff here")
    f = verbs.add_parser("refeed", help="a new run trained on this run's trajectories, without generation")
    _shared(f, suppress=True)
    f.add_argument("--source", choices=("batches", "scored"), default="batches")
    f.add_argument("--steps", type=int, default=None, help="at most this many batches (default: all)")
    f.add_argument("--config", default=None, help="TOML/JSON of DoraConfig fields overriding the recorded config")
    f.add_argument("--new-run-id", default=None)
    f.add_argument("--no-train", action="store_true", help="only record the run and write its batches")
    e = verbs.add_parser("export", help="a run's records to Parquet, filtered, with the schema docs")
    _shared(e, suppress=True)
    e.add_argument("--out", dest="export_out", required=True, help="Parquet file to write")
    e.add_argument("--topic", dest="export_topic", default=SCORED)
    e.add_argument("--version", dest="export_version", type=int, default=None, help="key version")
    e.add_argument("--group", dest="export_group", default=None)
    e.add_argument("--finish-reason", default=None, choices=("STOP", "LENGTH", "ABORT"))
    e.add_argument("--staleness", type=_range, default=None, metavar="LO:HI")
    e.add_argument("--reward", type=_range, default=None, metavar="LO:HI")
    a = verbs.add_parser("archive", help="a finished run's records (and checkpoints) to Parquet under a directory")
    _shared(a, suppress=True)
    a.add_argument("--out", dest="archive_out", required=True, help="directory to create")
    a.add_argument("--topics", default=None, help="comma-separated topics (default: all but dora.state)")
    a.add_argument("--allow-running", action="store_true", help="archive a run still STARTED")


def _source(args: argparse.Namespace, bootstrap: Callable[[], str]) -> Any:
    if getattr(args, "from_archive", None):
        from .archive import ArchiveSource

        source = ArchiveSource(Path(args.from_archive))
        if args.run and args.run != source.run_info().run_id:
            raise ValueError(f"archive {args.from_archive} holds run {source.run_info().run_id}, not {args.run}")
        return source
    from .source import KafkaSource

    return KafkaSource(bootstrap(), args.run)


def _write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def run_verb(args: argparse.Namespace, bootstrap: Callable[[], str]) -> int:
    """Run the verb ``args`` name (``dump`` when none); ``bootstrap()`` is asked only when needed."""
    verb = args.verb or "dump"
    source = _source(args, bootstrap)
    if verb == "dump":
        from .dump import dump

        out = open(args.out, "w") if args.out else sys.stdout
        try:
            n = dump(source, args.topic, out, version=args.version, group=args.group)
        finally:
            if args.out:
                out.close()
        print(f"replayed {n} records", file=sys.stderr)
        return 0
    if verb == "retrain":
        from .retrain import retrain

        report = retrain(source, args.step, dict(args.set_reward) or None)
        print(report.render())
        _write_json(args.json, {**asdict(report), "match": [s.match for s in report.steps]})
        return 0 if all(s.match for s in report.steps if not s.edited) else 1
    if verb == "rescore":
        from .rescore import rescore

        diff = rescore(source, args.reward_fn, args.rescore_topic, args.rescore_version, args.rescore_group)
        print(diff.render())
        _write_json(args.json, diff.to_dict())
        return 0
    if verb == "refeed":
        from .refeed import refeed

        overrides: dict[str, Any] = {}
        if args.config:
            import tomllib

            text = Path(args.config).read_text()
            overrides = tomllib.loads(text) if args.config.endswith(".toml") else json.loads(text)
        result = refeed(source, bootstrap(), args.source, args.steps, overrides, args.new_run_id, not args.no_train)
        print(result.render())
        return 0
    if verb == "export":
        from .export import ExportFilter, export

        where = ExportFilter(args.export_version, args.export_group, args.finish_reason, args.staleness, args.reward)
        res = export(source, args.export_topic, Path(args.export_out), where)
        print(f"exported {res.rows} rows of {res.topic} ({len(res.columns)} columns) to {res.path}")
        return 0
    from .archive import DEFAULT_TOPICS, archive

    names = tuple(t.strip() for t in args.topics.split(",")) if args.topics else DEFAULT_TOPICS
    done = archive(source, Path(args.archive_out), names, allow_running=args.allow_running)
    print(f"archived run {done.run_id} to {done.path}: {sum(done.records.values())} records "
          f"({', '.join(f'{t} {n}' for t, n in done.records.items())}), {done.checkpoints} checkpoints")
    return 0
