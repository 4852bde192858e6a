"""Entry points of the roles, each startable alone against a broker: ``dora-rl <role> --run-id ID``.

A role needs only the bootstrap servers and the run id: the run's config and start offsets come
from its record on ``dora.runs``, so roles can be started on other machines, in any order (each waits
for what it reads). The weight channel's shared token comes from ``DORA_WEIGHT_TOKEN_FILE`` (written by
``dora-rl create`` / ``run``) or ``DORA_WEIGHT_TOKEN``. Lifecycle without a launcher: the trainer records
the run ``FINISHED`` when it reaches the run's steps; ``FAILED`` is recorded by whoever supervises the
roles (``dora-rl run``'s launcher, or an operator with ``dora-rl resume``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from dora_rl.config import DoraConfig
from dora_rl.infra.broker.dist import dora_home
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.runs import get_run, offsets_map, topic_start
from dora_rl.infra.observability.prom_serve import serve as serve_metrics

log = logging.getLogger(__name__)
ROLES = ("trainer", "rollout", "scorer", "assembler", "orchestrator", "dataset")


def run_dir(run_id: str) -> Path:
    """``$DORA_HOME/runs/<run_id>`` (created). It and ``runs/`` are 0700: the run's token, checkpoints and
    ``file``-transport weights beneath are its owner's alone."""
    path = dora_home() / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    for private in (path.parent, path):
        if private.stat().st_mode & 0o077:
            private.chmod(0o700)
    return path


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals a role stops on gracefully (hands its work back, commits, closes), then exits ``128 + signum``."""


class StopFlag:
    """Set by the first of :data:`STOP_SIGNALS`; roles that loop poll :meth:`is_set`.

    :meth:`exit_code` is 0 when no signal came (the role finished its work) and ``128 + signum`` after one,
    the shell's convention: a supervisor then tells "finished" (0) from "stopped before the end" and
    starts the role again unless it stopped it itself (``dora_rl.supervisor``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def install(self) -> StopFlag:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + self.signum


def weight_token() -> str:
    """The run's weight-channel token: ``DORA_WEIGHT_TOKEN_FILE`` (a file written by ``dora-rl create`` /
    ``run``, copied to each host) or ``DORA_WEIGHT_TOKEN``; empty when neither is set."""
    from_file = _secret_from_file("DORA_WEIGHT_TOKEN_FILE", "the weight token")
    return from_file if from_file is not None else os.environ.get("DORA_WEIGHT_TOKEN", "")


def _secret_from_file(variable: str, what: str) -> str | None:
    """The secret in the file that environment ``variable`` names (None when unset); an unreadable file is an
    error naming the variable and ``what`` it should hold."""
    path = os.environ.get(variable)
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise FileNotFoundError(f"{variable}={path}: cannot read {what} ({exc})") from exc


WEIGHT_TOKEN_FILE = "weight-token"
"""The token's file in a run directory, written by ``dora-rl create`` (``launcher.weight_token_file``)."""

TRAINER_KEY_FILE = "trainer-key"
"""The trainer's own key in a run directory (``launcher.trainer_key_file``): ``dora-rl run`` hands it to the
trainer alone, which signs its ``done`` with it, so no other role of the run (each holds the weight token)
can end the run (decision 0057)."""


def trainer_key() -> str:
    """The key the trainer signs its ``done`` with: ``DORA_TRAINER_KEY_FILE``; empty when unset (then the
    trainer signs with the weight token, as a run started by hand does)."""
    return _secret_from_file("DORA_TRAINER_KEY_FILE", "the trainer's key") or ""


SCORER_KEY_FILE = "scorer-key"
"""The scorer's key in a run directory (``launcher.scorer_key_file``): ``dora-rl run`` hands it to the scorer,
which signs every score with it, and to the assembler, which trains only scores signed with it; no other role
holds it, so no other writer of ``dora.rollout.scored`` can plant a reward (decision 0059)."""


def scorer_key() -> str:
    """The key scores are signed and checked with: ``DORA_SCORER_KEY_FILE``; empty when unset (then the scorer
    and the assembler use the weight token, as a run started by hand without the variable does)."""
    return _secret_from_file("DORA_SCORER_KEY_FILE", "the scorer's key") or ""


def run_scorer_key(run_id: str) -> str:
    """:func:`scorer_key`, else the key ``dora-rl create`` left in this host's run directory, else empty (then
    the audit cannot check who scored)."""
    path = dora_home() / "runs" / run_id / SCORER_KEY_FILE
    return scorer_key() or (path.read_text().strip() if path.exists() else "")


def run_token(run_id: str) -> str:
    """:func:`weight_token`, else the token ``dora-rl create`` left in this host's run directory, else empty (an
    operator's command, such as the audit, on the host that created the run needs no variable)."""
    token = weight_token()
    path = dora_home() / "runs" / run_id / WEIGHT_TOKEN_FILE
    return token or (path.read_text().strip() if path.exists() else "")


def start_role(role: str, bootstrap: str, run_id: str | None, index: int | str = 0,
               instance_name: str | None = None) -> int:
    """Run one role of run ``run_id`` (latest run if None) until it finishes or is signalled; returns the
    process's exit code (:meth:`StopFlag.exit_code`: 0 finished, ``128 + signum`` stopped by a signal).

    A rollout instance with ``index="auto"`` claims a free index (:mod:`dora_rl.core.instance_ids`);
    ``instance_name`` (stable across restarts) gets the same index back."""
    token = weight_token()
    info = get_run(bootstrap, run_id, token)  # with a token, only a record signed with it (decision 0060)
    config = DoraConfig.from_json(info.config_json)
    start = offsets_map(info)
    stop = StopFlag().install()
    if index == "auto":
        if role != "rollout":
            raise ValueError(f"--index auto is for rollout instances, not {role}")
        from dora_rl.producers.rollout.identity import claim_index, default_name

        index = claim_index(bootstrap, info.run_id, config.instance_limit, start, instance_name or default_name(),
                            config.instance_concurrency)
    index = int(index)
    log.info("starting %s for run %s (mode %s)", role, info.run_id, config.mode)
    if role != "dataset":  # every long-running role serves /metrics (infra/observability/prom_serve.py)
        serve_metrics(bootstrap, info.run_id, role, f"{role}-{index}" if role in ("rollout", "scorer") else role)
    if role == "trainer":
        from dora_rl.consumers.trainer.role import run_trainer

        run_trainer(bootstrap, info.run_id, config, start, run_dir(info.run_id), token or None, stop.is_set,
                    done_key=trainer_key())
    elif role == "rollout":
        from dora_rl.producers.rollout.worker import run_rollout

        run_rollout(bootstrap, info.run_id, config, index, start, token, stop.is_set)
    elif role == "scorer":
        from dora_rl.streams.reward_scorer import run_scorer

        run_scorer(bootstrap, info.run_id, start, config.num_partitions, stop.is_set, reward_fn=config.reward_fn,
                   reward_timeout_s=config.reward_timeout_s, max_attempts=config.max_attempts, token=token,
                   scorer_key=scorer_key())
    elif role == "assembler":
        from dora_rl.streams.assembler import run_assembler

        run_assembler(bootstrap, info.run_id, config, start, stop=stop.is_set, token=token, scorer_key=scorer_key())
    elif role == "orchestrator":
        from dora_rl.streams.orchestrator import run_orchestrator

        run_orchestrator(bootstrap, info.run_id, config, start, stop=stop.is_set, token=token)
    elif role == "dataset":
        from dora_rl.policy_source import prompt_encoder, resolve_model
        from dora_rl.producers.dataset import produce_prompts

        encode = prompt_encoder(resolve_model(config.model, config.seed))  # the prompts' token ids: no weights
        prompts_start = topic_start(start, topics.in_run(info.run_id, topics.PROMPTS))
        n = produce_prompts(bootstrap, info.run_id, config, prompts_needed(config), encode, prompts_start, token)
        log.info("wrote %d prompts", n)
    else:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    return stop.exit_code()


def prompts_needed(config: DoraConfig) -> int:
    """Prompts a run consumes: one wave of TBS/G per step, plus the RBS over-provisioning."""
    return (config.steps * config.train_batch_size + config.rollout_batch_size) // config.group_size
