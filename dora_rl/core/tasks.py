"""Verifiable-reward synthetic tasks with long-tailed answer lengths.

A :class:`Task` draws ``TaskSample(prompt, reference)`` pairs from a ``random.Random`` and scores a
completion (decoded text up to, excluding, EOS) against the reference with a reward in ``[0, 1]``.
Invariants checked in the tests: ``reward(ref, ref) == 1.0`` and ``0 <= reward <= 1`` always; the
same ``rng`` state always gives the same sample.

Lengths are long-tailed by construction: they come from a discrete truncated Pareto law,
``L = floor(lo / U ** (1 / alpha))`` with ``U ~ Uniform(0, 1]``, redrawn while ``L > hi``, i.e.
``P(L >= x) ∝ (lo / x) ** alpha - (lo / (hi + 1)) ** alpha`` for ``lo <= x <= hi``.
All vocabularies are inside the char-level tokenizer of :mod:`dora_rl.modeling`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TaskSample:
    """One problem: the text the policy sees and the reference answer its reward compares against."""

    prompt: str
    reference: str


class Task(Protocol):
    """A verifiable-reward task. ``reward`` must be a pure function of its two arguments."""

    @property
    def name(self) -> str: ...

    def sample(self, rng: random.Random) -> TaskSample: ...

    def reward(self, reference: str, completion: str) -> float: ...


def pareto_len(rng: random.Random, alpha: float, lo: int, hi: int) -> int:
    """Discrete truncated Pareto length in ``[lo, hi]`` (see the module docstring for the law)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo} hi={hi}")
    while True:
        u = 1.0 - rng.random()  # in (0, 1]: no division by zero
        length = int(lo / u ** (1.0 / alpha))
        if length <= hi:
            return length


@dataclass(frozen=True)
class ReverseTask:
    """Reverse a string: ``"dbihfa="`` -> ``"afhibd"``.

    String length ~ truncated Pareto(``lo=4, alpha=1.1, hi=112``) over the alphabet ``a..j``:
    p50 = 7, p90 ≈ 27, p99 ≈ 86 characters (p99/p50 ≈ 12), so a batch has a few long stragglers.
    The answer is as long as the string, plus EOS.

    Reward (dense partial credit): 1.0 for an exact match; else 0 if the completion length is off by
    more than 50 % of the reference length; else ``0.5 * matching_positions / max(len_ref, len_out)``
    (so any inexact answer scores < 0.5).
    """

    name: str = "reverse"
    lo: int = 4
    alpha: float = 1.1
    hi: int = 112
    alphabet: str = "abcdefghij"

    def sample(self, rng: random.Random) -> TaskSample:
        n = pareto_len(rng, self.alpha, self.lo, self.hi)
        s = "".join(rng.choice(self.alphabet) for _ in range(n))
        return TaskSample(prompt=s + "=", reference=s[::-1])

    def reward(self, reference: str, completion: str) -> float:
        if completion == reference:
            return 1.0
        if abs(len(completion) - len(reference)) > 0.5 * len(reference):
            return 0.0
        same = sum(a == b for a, b in zip(completion, reference, strict=False))
        return 0.5 * same / max(len(reference), len(completion), 1)


@dataclass(frozen=True)
class ChainsumTask:
    """Running sum mod 10 with a scratchpad and an outcome-only reward.

    ``"3+9+7+4="`` -> ``"33,92,79,43#3"``: for each term the answer copies the term and writes the
    new running sum mod 10 (two characters per step, comma separated), then ``#`` and the final sum.
    Term count ~ truncated Pareto(``lo=3, alpha=1.0, hi=48``), answer length ``3 * n + 1``
    characters (p50 = 16, p90 ≈ 58, p99 ≈ 127, max 145; p99/p50 ≈ 8).

    Reward: 1.0 iff the text after the completion's last ``#`` equals the reference's final digit
    exactly (the scratchpad itself is not checked), else 0.0.
    """

    name: str = "chainsum"
    lo: int = 3
    alpha: float = 1.0
    hi: int = 48

    def sample(self, rng: random.Random) -> TaskSample:
        n = pareto_len(rng, self.alpha, self.lo, self.hi)
        terms = [rng.randrange(10) for _ in range(n)]
        total, steps = 0, []
        for t in terms:
            total = (total + t) % 10
            steps.append(f"{t}{total}")
        return TaskSample(prompt="+".join(map(str, terms)) + "=", reference=",".join(steps) + f"#{total}")

    def reward(self, reference: str, completion: str) -> float:
        want = reference.rsplit("#", 1)[-1]
        if "#" not in completion:
            return 0.0
        got = completion.rsplit("#", 1)[-1]
        return 1.0 if got == want else 0.0


TASKS: dict[str, Callable[[], Task]] = {
    "reverse": ReverseTask,
    "chainsum": ChainsumTask,
}


def get_task(name: str) -> Task:
    """The task registered under ``name`` (``reverse`` or ``chainsum``)."""
    try:
        return TASKS[name]()
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None
