"""Reward functions by name, and the rule that checks one call: the pure half of the reward runner.

A reward function has the signature ``fn(task: str, reference: str, completion: str) -> float`` and
is named by a ``reward_fn`` string (``DoraConfig.reward_fn``): ``"task"`` is the task's own verifier
(``get_task(task).reward``, :func:`task_reward`); ``"math"``, ``"exact"``, ``"format"`` and
``"reasoning_gym"`` are the verifiers of :mod:`dora_rl.core.verifiers`; ``"module:function"``
(``"pkg.mod:obj.attr"``) is an entry point imported by the worker. A function signals a task it does
not handle by raising :class:`UnknownTaskError`.

Outcomes are typed: a float in ``[0, 1]`` or a :class:`RewardError` whose ``kind`` is ``timeout``,
``raised`` (with the exception type and message), ``invalid`` (not a number, non-finite, or out of
range), ``unknown_task`` or ``crashed`` (the worker died), and whose :attr:`RewardError.message`
names the item and the task; :func:`call_reward` is the one place a call's result is judged.

The processes that run the calls (a killable worker per runner, timeouts, replacement) are
:mod:`dora_rl.infra.reward_worker`'s :class:`~dora_rl.infra.reward_worker.RewardRunner`: the rules
here import no subprocess, socket or process machinery.
"""

from __future__ import annotations

import importlib
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from dora_rl.core import verifiers  # the named verifiers of BUILTIN; imports no heavy package
from dora_rl.core.training_input import reward_problem
from dora_rl.core.verifiers import UnknownTaskError

RewardFn = Callable[[str, str, str], float]
RewardErrorKind = Literal["timeout", "raised", "invalid", "unknown_task", "crashed"]
_DETAIL_MAX = 1000  # characters of an exception message or bad value kept in an error


@lru_cache(maxsize=64)
def _task(name: str) -> Any:
    from dora_rl.core.tasks import get_task

    try:
        return get_task(name)
    except KeyError as exc:
        raise UnknownTaskError(exc.args[0] if exc.args else name) from None


def task_reward(task: str, reference: str, completion: str) -> float:
    """The task's own verifier: ``get_task(task).reward(reference, completion)`` for a synthetic task,
    the dataset's own ``score_answer`` for a ``reasoning_gym:<name>`` task."""
    if task.startswith("reasoning_gym:"):
        return verifiers.reasoning_gym_reward(task, reference, completion)
    return float(_task(task).reward(reference, completion))


#: reward functions known by name (``DoraConfig.reward_fn``); anything else is ``module:function``
BUILTIN: dict[str, RewardFn] = {
    "task": task_reward,
    "math": verifiers.math_reward,
    "exact": verifiers.exact_reward,
    "format": verifiers.format_reward,
    "reasoning_gym": verifiers.reasoning_gym_reward,
}


def resolve_reward_fn(spec: str) -> RewardFn:
    """The function named by ``spec`` (a :data:`BUILTIN` name or ``module:function``); ValueError if none."""
    if ":" not in spec:
        if spec in BUILTIN:
            return BUILTIN[spec]
        raise ValueError(f"unknown reward function {spec!r}: use one of {sorted(BUILTIN)} or 'module:function'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r} is not of the form 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"reward function {spec!r} is not callable")
    return obj


@dataclass(frozen=True)
class RewardRequest:
    """One call to score: the trajectory's task, reference and completion; ``item`` names it in errors."""

    task: str
    reference: str
    completion: str
    item: str = ""


@dataclass(frozen=True)
class RewardError:
    """Why an item has no reward. ``message`` is the one line to log or dead-letter."""

    kind: RewardErrorKind
    detail: str
    task: str
    item: str = ""
    exc_type: str = ""  # for ``raised``: the exception's (qualified) type name
    reward_fn: str = ""

    @property
    def message(self) -> str:
        """E.g. ``reward 'task' of trajectory t1 (task 'reverse') failed: raised ValueError: boom``."""
        who = f"trajectory {self.item} " if self.item else ""
        what = f"raised {self.exc_type}: {self.detail}" if self.kind == "raised" else f"{self.kind}: {self.detail}"
        return f"reward {self.reward_fn!r} of {who}(task {self.task!r}) failed: {what}"


Outcome = float | RewardError
_Wire = float | tuple[str, str, str]  # worker -> parent per item: a reward or (kind, exc_type, detail)


def _clip(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[:_DETAIL_MAX] + "..."


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def call_reward(fn: RewardFn, task: str, reference: str, completion: str) -> _Wire:
    """One call, checked: the reward, or ``(kind, exc_type, detail)``. The validity rule lives here only."""
    try:
        value = fn(task, reference, completion)
    except UnknownTaskError as exc:
        return ("unknown_task", _type_name(exc), _clip(str(exc.args[0]) if exc.args else task))
    except Exception as exc:
        return ("raised", _type_name(exc), _clip(str(exc)))
    try:
        reward = float(value)
    except Exception:
        return ("invalid", "", _clip(f"returned {reprlib.repr(value)}, which is not a number"))
    problem = reward_problem(reward)
    if problem is not None:
        return ("invalid", "", f"returned {reward!r}: {problem}")
    return reward
