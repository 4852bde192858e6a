"""Roles placed by Ray (``dora-rl run --ray ADDRESS``): Ray decides where each role runs and starts it again
when it dies; Kafka stays the only channel between roles (Ray is placement, never transport).

- Each role of a run is one **detached, named Ray actor** (:class:`RoleActor`, name = the role's name, Ray
  namespace ``dora-<run id>``) asking for the resources of :func:`role_resources`. The actor runs
  ``dora-rl <role>`` as its child on its node (weight holders bind the node's address) and dies with it: a
  child that exits non-zero takes its actor down (``os._exit``), and Ray's own fault tolerance
  (``max_restarts``) starts the actor again, on any node with the resources, the node it ran on included
  unless that node is gone. A child that exits 0 has finished its work; its actor stays, idle. The child dies
  with its actor (``PR_SET_PDEATHSIG``), so a killed actor leaves no orphan role.
- The **desired number of rollout instances** lives in a small named actor (:class:`RunControl`) pinned to
  the driver's node (a hard affinity: Ray's soft one was seen placing it on a worker, where a lost or cut host
  took it down); ``dora-rl scale RUN_ID --instances N`` sets it and the driver adds instances (the smallest
  free indices, below ``max_instances``) or removes the highest ones (SIGTERM first: an instance hands its
  work back). The actor starts *unseeded* and the driver seeds it, only while unseeded, with the instances
  Ray holds for the run: a restarted control actor (Ray re-runs its constructor) never reverts a scale.
- The **driver** (:class:`RayRoles`, used by ``launcher.supervise`` in place of the local
  :class:`~dora_rl.supervisor.Supervisor`) only follows: it counts a restart when a role's (node, pid)
  changes, reports a role finished when its child exited 0, and fails the run when Ray gave up on a role
  (``MAX_RESTARTS`` restarts).

Secrets are never actor arguments (Ray stores those in its control store): a role gets only ``DORA_*``
variables naming files (the weight token, the role keys, the Kafka password), which must exist at the same
path on every node (a shared filesystem, or the files provisioned per host); the object store's
credentials come from the nodes' own environment.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from dora_rl.config import DoraConfig

log = logging.getLogger(__name__)

MAX_RESTARTS = 20
"""Restarts Ray grants one role before the run fails (node losses included)."""
STREAM_ROLES = ("dataset", "orchestrator", "scorer", "assembler")
WEIGHT_HOLDERS = ("trainer", "rollout")
CONTROL = "control"


def role_resources(config: DoraConfig, role: str) -> dict[str, Any]:
    """Ray resources of ``role``: a GPU per trainer rank and per rollout instance on a GPU run, one CPU
    for each weight holder, a quarter CPU for a stream role; ``config.ray_resources[role]`` (keys
    ``num_cpus``, ``num_gpus``, ``resources``) overrides per role."""
    gpu = config.device != "cpu" or config.engine == "vllm"
    base: dict[str, Any] = {"num_cpus": 0.25, "num_gpus": 0}
    if role == "trainer":
        base = {"num_cpus": 1, "num_gpus": config.trainer_ranks if gpu else 0}
    elif role == "rollout":
        base = {"num_cpus": 1, "num_gpus": 1 if gpu else 0}
    return {**base, **dict(config.ray_resources.get(role, {}))}


def scale_plan(current: list[int], desired: int, limit: int) -> tuple[list[int], list[int]]:
    """The instance indices to add and to remove to go from ``current`` to ``desired`` instances (clamped to
    ``1 .. limit``): new ones take the smallest free indices, the highest ones leave first."""
    desired = max(1, min(desired, limit))
    free = [i for i in range(limit) if i not in current]
    return free[: max(0, desired - len(current))], sorted(current, reverse=True)[: max(0, len(current) - desired)]


DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); "  # PR_SET_PDEATHSIG = SIGKILL
                   "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")
"""A trampoline the role is started through (``python -c DIE_WITH_PARENT <parent pid> <argv...>``): it asks the
kernel to SIGKILL it when its parent (the actor process) dies, exits if that parent is already gone (it died
before the request), then execs the role (same pid; the setting survives exec). No ``preexec_fn``: the actor
process has threads, and running Python between fork and exec is unsafe there."""


class RoleActor:
    """One role of a run on a Ray node (see the module docstring); wrapped by ``ray.remote`` at use."""

    def __init__(self, name: str, role: str, index: int, run_id: str, bootstrap: str, env: dict[str, str]) -> None:
        import ray

        from dora_rl.infra.broker.dist import dora_home

        self.node = ray.util.get_node_ip_address()
        home = Path(env["DORA_HOME"]) if env.get("DORA_HOME") else dora_home()  # the driver's, else this node's
        logs = home / "runs" / run_id / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), sys.executable, "-m", "dora_rl", role,
               "--bootstrap-servers", bootstrap, "--run-id", run_id, "--index", str(index)]
        if role in WEIGHT_HOLDERS:
            cmd += ["--bind-host", self.node]
        with (logs / f"{name}.log").open("a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=True)
        self.stopping = False
        self.code: int | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.code = self.proc.wait()
        if self.code != 0 and not self.stopping:
            os._exit(1)  # the actor dies with its role: Ray starts it again

    def status(self) -> dict[str, Any]:
        return {"node": self.node, "pid": self.proc.pid, "code": self.code}

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the role (an instance hands its work back), SIGKILL after ``timeout``; its exit code."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class RunControl:
    """The run's desired number of rollout instances (set by ``dora-rl scale``, read by the driver); ``None``
    until seeded. Invariant: a count once set changes only by :meth:`set_instances`, never by a seed."""

    def __init__(self) -> None:
        self.count: int | None = None

    def seed(self, n: int) -> int:
        """Set the count to ``n`` if nothing set it yet (a fresh or restarted actor); the count now."""
        if self.count is None:
            self.count = int(n)
        return self.count

    def set_instances(self, n: int) -> int:
        self.count = int(n)
        return self.count

    def instances(self) -> int | None:
        return self.count


def connect(address: str, run_id: str) -> Any:
    """``ray`` connected to the cluster at ``address`` (``host:port`` of its head, or ``auto``) in the run's
    namespace."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=f"dora-{run_id}", log_to_driver=False, logging_level=logging.WARNING)
    return ray


def scale(address: str, run_id: str, instances: int) -> int:
    """Ask the driver of ``run_id`` for ``instances`` rollout instances; returns the count now desired."""
    ray = connect(address, run_id)
    try:
        control = ray.get_actor(CONTROL)
    except ValueError as exc:
        raise LookupError(f"run {run_id} has no Ray driver on {address} (no {CONTROL!r} actor)") from exc
    return int(ray.get(control.set_instances.remote(instances), timeout=30))


class RayRoles:
    """The driver's view of a run's roles on Ray: the same interface as :class:`~dora_rl.supervisor.Supervisor`
    (``start``, ``check``, ``finished``, ``restarts``, ``placement``, ``stop``)."""

    placement_file = "placement.json"

    def __init__(self, address: str, run_id: str, bootstrap: str, config: DoraConfig,
                 env_of: Any) -> None:
        self.ray = connect(address, run_id)
        self.run_id, self.bootstrap, self.config, self.env_of = run_id, bootstrap, config, env_of
        self.actors: dict[str, Any] = {}
        self.roles: dict[str, tuple[str, int]] = {}
        self.seen: dict[str, tuple[str, int]] = {}
        self.counts: dict[str, int] = {}
        self.done: set[str] = set()
        self.failed: str | None = None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=False)
        self.control = self.ray.remote(RunControl).options(  # beside the driver: lost only with it
            name=CONTROL, lifetime="detached", num_cpus=0, max_restarts=-1, get_if_exists=True,
            scheduling_strategy=here).remote()

    def start(self, name: str, role: str, index: int = 0) -> None:
        """Place ``role`` (an existing actor of that name, a previous driver's, is adopted)."""
        actor_class = self.ray.remote(RoleActor)
        self.actors[name] = actor_class.options(
            name=name, lifetime="detached", max_restarts=MAX_RESTARTS, max_task_retries=0, get_if_exists=True,
            **role_resources(self.config, role)).remote(name, role, index, self.run_id, self.bootstrap,
                                                              self.env_of(role))
        self.roles[name] = (role, index)

    def finished(self, name: str) -> bool:
        return name in self.done

    def restarts(self) -> dict[str, int]:
        return {n: c for n, c in self.counts.items() if c}

    def placement(self) -> dict[str, Any]:
        return {n: {"node": node, "pid": pid} for n, (node, pid) in self.seen.items()}

    def check(self) -> str | None:
        """Follow every role (restarts, finished ones) and bring the instances to the desired count; the
        failure once Ray gave up on a role."""
        from ray.exceptions import RayError

        if self.failed:
            return self.failed
        self._scale_to(self._desired())
        asked = {a.status.remote(): n for n, a in self.actors.items() if n not in self.done}
        answered, _ = self.ray.wait(list(asked), num_returns=len(asked), timeout=5)  # the rest: restarting
        for ref in answered:
            name = asked[ref]
            try:
                st = self.ray.get(ref)
            except RayError as exc:  # restarting, its node being replaced, or dead for good
                if not self._registered(name):
                    self.failed = f"role {name}: Ray gave up on it after {MAX_RESTARTS} restarts ({exc})"
                    return self.failed
                continue
            where = (str(st["node"]), int(st["pid"]))
            if name in self.seen and self.seen[name] != where:
                self.counts[name] = self.counts.get(name, 0) + 1
                log.warning("role %s restarted by Ray on %s (pid %d)", name, *where)
            self.seen[name] = where
            if st["code"] == 0:
                self.done.add(name)
        return None

    def _registered(self, name: str) -> bool:
        """Whether Ray still holds the actor ``name`` (alive or restarting: a dead one's name is released)."""
        try:
            self.ray.get_actor(name)
            return True
        except ValueError:
            return False

    def _desired(self) -> int:
        """The count ``dora-rl scale`` asked for (an unseeded control actor is seeded with :meth:`_held`); the
        current one while the control actor does not answer."""
        from ray.exceptions import RayError

        try:
            count = self.ray.get(self.control.instances.remote(), timeout=5)
            if count is None:
                count = self.ray.get(self.control.seed.remote(self._held()), timeout=5)
                log.warning("the control actor was seeded: %d rollout instances desired", count)
            return int(count)
        except RayError as exc:
            log.warning("the control actor did not answer (%s): instances left as they are", exc)
            return len(self._instances())

    def _held(self) -> int:
        """The rollout instances Ray holds for this run (named ``rollout-<i>`` in its namespace, alive or
        restarting), those this driver started included: what was desired last, whichever driver scaled."""
        named = {str(n) for n in self.ray.util.list_named_actors() if str(n).startswith("rollout-")}
        return max(1, len(named | {f"rollout-{i}" for i in self._instances()}))

    def _instances(self) -> list[int]:
        return sorted(i for role, i in self.roles.values() if role == "rollout")

    def _scale_to(self, desired: int) -> None:
        """Add or remove instances by :func:`scale_plan`."""
        add, remove = scale_plan(self._instances(), desired, self.config.instance_limit)
        for index in add:
            log.warning("adding rollout instance %d (desired %d)", index, desired)
            self.start(f"rollout-{index}", "rollout", index)
        for index in remove:
            log.warning("removing rollout instance %d (desired %d)", index, desired)
            self._remove(f"rollout-{index}")

    def _remove(self, name: str) -> None:
        actor = self.actors.pop(name)
        self.roles.pop(name)
        self.seen.pop(name, None)
        try:
            self.ray.get(actor.stop.remote(), timeout=40)
        except Exception as exc:  # a dead or unreachable actor: nothing to stop, it is killed below
            log.warning("stopping %s: %s", name, exc)
        self.ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        """Stop every role at once (SIGTERM, then SIGKILL), then remove the actors and the control actor."""
        stopping = {a.stop.remote(): n for n, a in self.actors.items()}
        _, unanswered = self.ray.wait(list(stopping), num_returns=len(stopping), timeout=30)
        for ref in unanswered:  # dead, unplaceable or unreachable: nothing to stop gracefully, killed below
            log.warning("%s did not stop within 30 s: killed", stopping[ref])
        for actor in [*self.actors.values(), self.control]:
            self.ray.kill(actor, no_restart=True)
        self.actors.clear()
