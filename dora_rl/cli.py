"""``dora-rl``: one console command, a subcommand per role and per tool.

    dora-rl run [--steps N] [--mode M] [--config F] [--json OUT]   the whole loop (embedded broker by default)
    dora-rl create [--config F] [--run-id ID]                       record a run; roles join it from any host
    dora-rl resume RUN_ID [--steps N]                               continue a run whose launcher died
    dora-rl run|resume --ray ADDRESS ...                            the roles placed by a Ray cluster
    dora-rl scale RUN_ID --instances N --ray ADDRESS                a Ray-placed run: add or remove instances
    dora-rl broker start|stop|status [--cluster]                   the embedded Kafka broker
    dora-rl topics create|list|doc [--check]                        the topic catalogue (doc: generated docs)
    dora-rl trainer|rollout|scorer|assembler|orchestrator|dataset   one role of a run (--run-id, --index [auto],
                                                                    --bind-host, --advertised-host)
    dora-rl runs [--delete RUN_ID]                                  runs recorded on the cluster; delete one's topics
    dora-rl monitor [--run ID] [--follow]                           a run's progress; --follow: live, in place
    dora-rl dashboard [--run ID] [--bind H] [--port P]              a run's web page (timeline, curves, lag)
    dora-rl replay [dump|retrain|rescore|refeed|export|archive]     re-run a recorded run (default: JSON lines)
    dora-rl audit [--run ID] [--json F]                             check C1-C3 from the topics

Every command takes ``--bootstrap-servers`` (or env ``DORA_BOOTSTRAP_SERVERS``); without it,
``run`` starts the embedded broker and the others use the embedded broker if it is running.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dora_rl.config import MODES, DoraConfig
from dora_rl.infra.observability.logs import setup_logging
from dora_rl.roles import ROLES


def _bootstrap(args: argparse.Namespace, start: bool = False, check: bool = True) -> str:
    from dora_rl.infra.broker.server import require_reachable, resolve_bootstrap
    from dora_rl.launcher import embedded_broker

    given = resolve_bootstrap(args.bootstrap_servers)
    if given:
        if check:  # roles pass False: they wait out a broker restart in the client's retries
            require_reachable(given)
        return given
    broker = embedded_broker()
    if broker.is_running():
        return broker.bootstrap_servers
    if start:
        return broker.start().bootstrap_servers
    raise SystemExit("no broker: pass --bootstrap-servers, set DORA_BOOTSTRAP_SERVERS, or `dora-rl broker start`")


def cmd_run(args: argparse.Namespace) -> int:
    from dora_rl.infra.broker.server import resolve_bootstrap
    from dora_rl.launcher import run

    config = _run_config(args)
    summary = run(config, resolve_bootstrap(args.bootstrap_servers), Path(args.json) if args.json else None,
                  quiet=args.quiet, ray_address=args.ray)
    _print_summary(summary)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from dora_rl.infra.broker.server import resolve_bootstrap
    from dora_rl.infra.kafka.runs import RetentionGap
    from dora_rl.launcher import resume

    try:
        summary = resume(args.run_id, resolve_bootstrap(args.bootstrap_servers), steps=args.steps,
                         json_path=Path(args.json) if args.json else None, quiet=args.quiet, ray_address=args.ray)
    except RetentionGap as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    _print_summary(summary)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from dora_rl.ray_placement import scale

    print(f"run {args.run_id}: {scale(args.ray, args.run_id, args.instances)} rollout instances desired")
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    r = summary["reward_per_step"]
    print(f"run {summary['run_id']} ({summary['mode']}): {summary['steps']} steps in {summary['wall_s']:.1f}s "
          f"(warm-up {summary['warmup_s']:.1f}s), reward first5 {summary['reward_first5']:.3f} -> last5 "
          f"{summary['reward_last5']:.3f}, {summary['throughput_tokens_per_s']:.0f} trained tok/s, "
          f"max staleness {summary['max_staleness_seen']:.0f}, restarts {summary['restarts']}; "
          f"per step: {[round(x, 3) for x in r]}")


def cmd_broker(args: argparse.Namespace) -> int:
    from dora_rl.infra.broker import server as b

    security = b.BrokerSecurity() if args.secure else None
    if args.secure and args.action != "start":
        raise SystemExit("--secure applies to `start` only")
    if args.cluster:
        if args.action != "start":
            raise SystemExit("--cluster supports only `start` (it runs in the foreground until Ctrl-C)")
        from dora_rl.infra.broker.cluster import LocalCluster

        cluster = LocalCluster(security=security)
        cluster.start()
        print(cluster.bootstrap_servers, flush=True)
        if security is not None:
            _print_client_config(cluster.nodes[0].secrets.client_config_file)
        try:
            import time

            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            cluster.stop()
        return 0
    if args.action == "start":
        from dora_rl.launcher import embedded_broker

        broker = embedded_broker()
        if security is not None:  # same data dir and ports, SASL_SSL + ACLs; adopts a running secured broker
            broker = b.LocalBroker(broker.data_dir, port=broker.port, controller_port=broker.controller_port,
                                   security=security)
        broker.start()
        if security is not None and broker.security is None:
            raise SystemExit("the embedded broker is running without security: `dora-rl broker stop` it first")
        print(json.dumps(broker.status(), indent=2))
        if broker.security is not None:
            _print_client_config(broker.secrets.client_config_file)
    elif args.action == "stop":
        print("stopped" if b.stop_broker() else "not running")
    else:
        print(json.dumps(b.broker_status(), indent=2))
    return 0


def _print_client_config(path: Path) -> None:
    """Where the admin's client config is (0600; it names the password file, never holds the password)."""
    print(f"admin client config: {path}\n  export DORA_KAFKA_CLIENT_CONFIG={path}", flush=True)


def cmd_topics(args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.security import client_config
    from dora_rl.infra.kafka.topic_admin import ensure_topics

    if args.action == "doc":  # docs/topics.md + README table from the catalogue; needs no broker
        from dora_rl.infra.kafka.topic_docs import sync_docs

        return sync_docs(check=args.check)
    if args.action == "create":  # `list` prints the catalogue and needs no broker
        bootstrap = _bootstrap(args, start=True)
        result = ensure_topics(AdminClient(client_config(bootstrap)), args.partitions)
        for name, state in result.items():
            print(f"{name:32s} {state}")
    else:
        for s in topics.catalogue(args.partitions):
            print(f"{s.name:32s} partitions={s.partitions:<3d} {s.schema:24s} {s.doc}")
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    import os

    from dora_rl.infra.endpoints import ADVERTISED_ENV, BIND_ENV
    from dora_rl.roles import start_role

    if args.bind_host:  # the process's endpoints (infra/endpoints.py) come from its environment
        os.environ[BIND_ENV] = args.bind_host
    if args.advertised_host:
        os.environ[ADVERTISED_ENV] = args.advertised_host
    index: int | str = args.index if args.index == "auto" else int(args.index)
    return start_role(args.command, _bootstrap(args, check=False), args.run_id, index,
                      instance_name=args.instance_name)


def cmd_create(args: argparse.Namespace) -> int:
    from dora_rl.launcher import create

    config = _run_config(args)
    info, token_file = create(config, _bootstrap(args), run_id=args.run_id)
    print(info.run_id)
    print(f"run {info.run_id} recorded (no role started); weight-channel token in {token_file} (copy it to every "
          f"host as DORA_WEIGHT_TOKEN_FILE); start each role with: dora-rl <role> --run-id {info.run_id}",
          file=sys.stderr)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka.runs import get_run, list_runs
    from dora_rl.infra.kafka.security import client_config
    from dora_rl.infra.kafka.topic_admin import delete_run_topics, run_topic_names

    bootstrap = _bootstrap(args)
    admin = AdminClient(client_config(bootstrap))
    if args.delete:
        info = get_run(bootstrap, args.delete)
        if info.state == "STARTED":
            print(f"run {info.run_id} is not over (STARTED): stop it first (its launcher's Ctrl-C), or finish it "
                  f"with `dora-rl resume {info.run_id}`", file=sys.stderr)
            return 2
        deleted = delete_run_topics(admin, info.run_id)
        print(f"run {info.run_id}: deleted {len(deleted)} topics (its record on dora.runs stays)")
        return 0
    runs = list_runs(bootstrap)  # first: a refused credential fails here at once, naming its code
    existing = set(admin.list_topics(timeout=30).topics)
    for run_id, info in runs.items():
        kept = "" if set(run_topic_names(run_id)) <= existing else "  topics deleted"
        print(f"{run_id}  {info.state:9s} mode={info.mode}{kept}")
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from dora_rl.consumers.monitor import monitor

    monitor(_bootstrap(args), args.run, follow=args.follow, refresh_s=args.refresh)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from dora_rl.consumers.dashboard.server import DashboardServer
    from dora_rl.infra.endpoints import Endpoints

    bind = args.bind or Endpoints.from_env().bind_host
    DashboardServer(_bootstrap(args), args.run, bind, args.port, args.advertised_host).serve(out=sys.stdout)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from dora_rl.consumers.replay.command import run_verb

    return run_verb(args, lambda: _bootstrap(args))


def cmd_audit(args: argparse.Namespace) -> int:
    from dora_rl.consumers.audit import audit_run, audit_source
    from dora_rl.roles import run_scorer_key, run_token

    if args.from_archive:  # no broker: the archive holds the run's records (and its token is not in it)
        from dora_rl.consumers.replay.archive import ArchiveSource

        source = ArchiveSource(Path(args.from_archive))
        report = audit_source(source, args.token_file.read_text().strip() if args.token_file else "")
    else:
        from dora_rl.infra.kafka.runs import get_run

        bootstrap = _bootstrap(args)
        run_id = get_run(bootstrap, args.run).run_id
        report = audit_run(bootstrap, run_id, run_token(run_id), run_scorer_key(run_id))
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


def _run_config_args(p: argparse.ArgumentParser) -> None:
    """The options that make a run's config (``run`` and ``create``): a file, then flags over it."""
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--mode", choices=MODES, default=None)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--instances", type=int, default=None)
    p.add_argument("--weight-transport", choices=("ucx", "tcp", "file"), default=None)
    p.add_argument("--reward", choices=("builtin", "external"), default=None,
                   help="external: start no scorer; an outside service scores (docs/integration.md)")
    p.add_argument("--config", default=None, help="TOML or JSON file of DoraConfig fields")


def _run_config(args: argparse.Namespace) -> DoraConfig:
    """The config ``_run_config_args`` describes."""
    return DoraConfig.load(args.config, steps=args.steps, mode=args.mode, max_staleness=args.max_staleness,
                           weight_transport=args.weight_transport, num_instances=args.instances,
                           reward_service=args.reward)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the docs test)."""
    parser = argparse.ArgumentParser(prog="dora-rl", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap-servers", default=None,
                        help="Kafka bootstrap servers (env DORA_BOOTSTRAP_SERVERS)")
    sub = parser.add_subparsers(dest="command", required=True)

    ray = argparse.ArgumentParser(add_help=False)
    ray.add_argument("--ray", default=None, metavar="ADDRESS",
                     help="place the roles on this Ray cluster (its head's host:port, or 'auto')")
    p = sub.add_parser("run", parents=[common, ray], help="run the whole RL loop")
    _run_config_args(p)
    p.add_argument("--json", default=None, help="write the machine-readable summary here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("scale", help="a run placed by Ray: change its number of rollout instances")
    p.add_argument("run_id")
    p.add_argument("--instances", type=int, required=True)
    p.add_argument("--ray", required=True, metavar="ADDRESS", help="the Ray cluster (head host:port, or 'auto')")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("create", parents=[common], help="record a run without starting roles (multi-host)")
    _run_config_args(p)
    p.add_argument("--run-id", default=None, help="the run's id (default: a new one)")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("resume", parents=[common, ray],
                       help="continue a run whose launcher died (roles restore from Kafka)")
    p.add_argument("run_id")
    p.add_argument("--steps", type=int, default=None, help="continue to this many steps (default: the run's)")
    p.add_argument("--json", default=None, help="write the machine-readable summary here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("broker", help="the embedded Kafka broker")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--cluster", action="store_true", help="a 3-node loopback cluster (foreground)")
    p.add_argument("--secure", action="store_true",
                   help="SASL_SSL (SCRAM-SHA-512) + ACLs; writes an admin client config (0600) in the broker dir")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("topics", parents=[common], help="the topic catalogue")
    p.add_argument("action", choices=("create", "list", "doc"))
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--check", action="store_true", help="doc: fail (exit 1) if the generated docs drifted")
    p.set_defaults(func=cmd_topics)

    for role in ROLES:
        p = sub.add_parser(role, parents=[common], help=f"run the {role} role of a run")
        p.add_argument("--run-id", default=None, help="run to join (default: the latest)")
        p.add_argument("--index", default="0",
                       help="instance index (rollout, scorer); rollout: 'auto' claims a free one (multi-host)")
        p.add_argument("--instance-name", default=None,
                       help="with --index auto: a stable name gets its index back on restart (default: a new one)")
        p.add_argument("--bind-host", default=None, help="address the weight holders bind (env DORA_BIND_HOST)")
        p.add_argument("--advertised-host", default=None,
                       help="address announced to peers (env DORA_ADVERTISED_HOST; default: the bind host)")
        p.set_defaults(func=cmd_role)

    p = sub.add_parser("runs", parents=[common], help="list runs (or delete a finished run's topics)")
    p.add_argument("--delete", metavar="RUN_ID", default=None,
                   help="delete the topics of this run, once it is over (decision 0063)")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("monitor", parents=[common], help="a run's metrics, live")
    p.add_argument("--run", default=None)
    p.add_argument("--follow", action="store_true", help="a live view redrawn in place until Ctrl-C")
    p.add_argument("--refresh", type=float, default=1.0, help="--follow: seconds between redraws")
    p.set_defaults(func=cmd_monitor)

    p = sub.add_parser("dashboard", parents=[common], help="a run's web dashboard (running or finished)")
    p.add_argument("--run", default=None, help="the run (default: the latest)")
    p.add_argument("--bind", default=None, help="address to listen on (default DORA_BIND_HOST, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (0: a free one; the URL is printed)")
    p.add_argument("--advertised-host", default=None, help="host named in the printed URL (default: the bind)")
    p.set_defaults(func=cmd_dashboard)

    from dora_rl.consumers.replay.command import add_arguments as replay_arguments

    p = sub.add_parser("replay", parents=[common], help="re-run a recorded run: dump (default, JSON lines), "
                       "retrain, rescore, refeed, export, archive")
    replay_arguments(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", parents=[common], help="check C1-C3 of a run from its topics")
    p.add_argument("--run", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--from-archive", default=None, metavar="DIR", help="audit a run archive instead of Kafka")
    p.add_argument("--token-file", type=Path, default=None,
                   help="with --from-archive: the run's weight-token file, to refuse forged announcements too")
    p.set_defaults(func=cmd_audit)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return int(args.func(args))
    except (ValueError, LookupError, FileNotFoundError, RuntimeError) as exc:
        # user-facing tools print one line; roles (running unattended) log the traceback too
        logging.getLogger("dora_rl").error("%s: %s", type(exc).__name__, exc, exc_info=args.command in ROLES)
        return 2


if __name__ == "__main__":
    sys.exit(main())
