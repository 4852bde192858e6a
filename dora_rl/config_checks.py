"""Field-level checks of :class:`~dora_rl.config.DoraConfig`: types from its annotations, ranges from a table,
and a "did you mean" for unknown keys and values (pure; no I/O).

Type rules: ``bool`` is only ``True``/``False`` (never ``"false"`` or 1); ``int`` is an integer and not a bool;
``float`` is an int or a float, finite; ``str`` is a string; ``Literal[...]`` is one of its values exactly
(``"vLLM"`` is refused, suggesting ``"vllm"``); ``X | None`` is None or an ``X``; ``dict[...]`` is a mapping.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union

AT_LEAST: dict[str, float] = {
    "max_staleness": 0, "steps": 1, "train_batch_size": 1, "rollout_batch_size": 1, "group_size": 2,
    "num_instances": 1, "max_instances": 0, "instance_concurrency": 1, "max_new_tokens": 1, "gym_size": 1,
    "heldout": 0, "eval_every": 0, "eval_prompts": 1, "max_attempts": 1, "sft_steps": 0, "micro_tokens": 0,
    "vocab_size": 0, "trainer_ranks": 1, "lr_warmup_steps": 0, "ppo_epochs": 1, "minibatches": 1, "num_partitions": 1,
    "checkpoint_every": 1, "modelled_train_s_fixed": 0.0, "modelled_train_s_per_token": 0.0,
}
"""Inclusive lower bounds (``group_size`` >= 2: a group of one has advantage 0, so nothing would be learned)."""

ABOVE: dict[str, float] = {
    "temperature": 0.0, "reward_timeout_s": 0.0, "sft_lr": 0.0, "lr": 0.0, "clip_eps": 0.0, "tis_cap": 0.0,
    "repartition_s": 0.0, "heartbeat_s": 0.0, "instance_timeout_s": 0.0,
}
"""Exclusive lower bounds."""


def suggest(word: str, options: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option (case-insensitive first), or ``""``."""
    opts = [str(o) for o in options]
    folded = [o for o in opts if o.lower() == str(word).lower()]
    close = folded or difflib.get_close_matches(str(word), opts, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` is not of ``hint``, or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return None if any(value == a and type(value) is type(a) for a in args) else \
            f"must be one of {list(args)}{suggest(value, args) if isinstance(value, str) else ''}"
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        problems = [_type_problem(value, a) for a in args if a is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "must be a finite number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if origin is dict:
        return None if isinstance(value, dict) else "must be a table (mapping)"
    return None


def field_problems(config: Any) -> list[str]:
    """Every field of the dataclass instance ``config`` whose value breaks its type or range, as text."""
    out: list[str] = []
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        problem = _type_problem(value, hints[f.name])
        if problem is None and value is not None and not isinstance(value, bool | str | dict):
            if f.name in AT_LEAST and value < AT_LEAST[f.name]:
                problem = f"must be >= {AT_LEAST[f.name]:g}"
            elif f.name in ABOVE and value <= ABOVE[f.name]:
                problem = f"must be > {ABOVE[f.name]:g}"
        if problem is None and f.name.endswith("_url") and value is not None:
            problem = url_problem(value)
        if problem is not None:
            out.append(f"{f.name} = {value!r}: {problem}")
    return out


def url_problem(url: str) -> str | None:
    """Why ``url`` is no storage URL for a run (``scheme://bucket/path``, no credentials, no ``..``), or None."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme or not rest.strip("/"):
        return "must be a URL such as s3://bucket/prefix (a local path needs no setting: the run directory is used)"
    if "@" in rest.split("/", 1)[0]:
        return "must not carry credentials: give them to the storage client's environment (e.g. AWS_ACCESS_KEY_ID)"
    if ".." in rest.split("/"):
        return "must not contain '..'"
    return None


def unknown_keys(cls: type, keys: typing.Iterable[str]) -> list[str]:
    """Each key that is no field of ``cls``, with its closest field."""
    names = [f.name for f in dataclasses.fields(cls)]
    return [f"{k!r}{suggest(k, names)}" for k in sorted(set(keys) - set(names))]
