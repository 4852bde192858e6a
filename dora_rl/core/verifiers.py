"""Verifiers: reward functions ``fn(task, reference, completion) -> float`` for real prompt data.

Registered in :data:`dora_rl.core.rewards.BUILTIN` (run them through
:class:`~dora_rl.infra.reward_worker.RewardRunner`, which owns the timeout):

* ``"math"`` (:func:`math_reward`): math-verify equivalence of the completion's final answer with
  the reference (``\\frac12``, ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal);
* ``"exact"`` (:func:`exact_reward`): string equality after a light normalisation;
* ``"format"`` (:func:`format_reward`): whether the completion gives its answer as ``\\boxed{...}``;
* ``"reasoning_gym"`` (:func:`reasoning_gym_reward`): the reasoning-gym dataset's own
  ``score_answer``, on a leniently extracted answer.

Each is a pure function of its arguments (caches aside) returning 0.0 or 1.0 (``reasoning_gym``:
the dataset's score, which may be partial). ``math``, ``exact`` and ``format`` ignore ``task``.
A reference that cannot be used (blank for math-verify; not a reasoning-gym reference)
raises ValueError: a data error, reported by the runner as a ``raised`` outcome, not a 0 reward.

math-verify and reasoning-gym are imported on the first call (about 0.7 s and 1.3 s), so the
runner's ``timeout_s`` must cover that on a worker's first item. math-verify is called with its own
``signal.alarm`` timeouts off (``parsing_timeout=None``, ``timeout_seconds=None``): the runner's
per-call timeout kills a hung worker instead, and this works on any thread. It logs one warning
per process saying so.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from dora_rl.core.prompt_data import GYM_PREFIX, dumps_tagged, loads_tagged, parse_gym_reference


class UnknownTaskError(KeyError):
    """Raised by a reward function for a task it does not score (outcome kind ``unknown_task``)."""


_BOXED = re.compile(r"\\boxed\s*\{")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER = re.compile(r"answer\s*:", re.I)
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_LATEX_MARKERS = ("$", "\\(", "\\[", "\\boxed")


def extract_boxed(text: str) -> str | None:
    """The content of the last closed ``\\boxed{...}`` in ``text`` (braces balanced), else None."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


# ---------------------------------------------------------------------------------------- math

@lru_cache(maxsize=4096)
def _parse_gold(reference: str) -> tuple[Any, ...]:
    from math_verify import parse

    ref = reference.rsplit("####", 1)[-1].strip()  # GSM8K style: "... #### 72"
    gold: list[Any] = []
    if not any(m in ref for m in _LATEX_MARKERS):
        gold = parse(f"${ref}$", parsing_timeout=None)  # bare \frac12 or 3\sqrt{2} need delimiters
    if not gold:
        gold = parse(ref, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference {reference[:200]!r}")
    return tuple(gold)


def math_reward(task: str, reference: str, completion: str) -> float:
    """1.0 iff the completion's final answer is mathematically equal to ``reference``, else 0.0.

    The final answer is the content of the last ``\\boxed{...}`` if there is one, else what
    math-verify's own extraction finds in the whole completion (an anchor such as ``final answer
    is``/``Answer:`` first, else the last number or LaTeX expression). The reference may be bare
    (``0.5``, ``\\frac12``, ``x^2+1``: parsed as LaTeX inside ``$...$``), already delimited
    (``$...$``, ``\\boxed{...}``) or GSM8K style (the text after the last ``####``); math-verify
    falls back to comparing text for a reference it cannot read as math, and one it finds nothing in
    (blank) raises ValueError. Compared with ``math_verify.verify(gold, answer)``, gold first.
    """
    from math_verify import parse, verify

    gold = list(_parse_gold(reference))
    boxed = extract_boxed(completion)
    answer = parse(f"\\boxed{{{boxed}}}" if boxed is not None else completion, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


# ---------------------------------------------------------------------------------------- exact, format

def normalize_exact(text: str) -> str:
    """``text`` without surrounding whitespace and one trailing period (``" 42. "`` -> ``"42"``)."""
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_reward(task: str, reference: str, completion: str) -> float:
    """1.0 iff ``normalize_exact(completion) == normalize_exact(reference)`` (case-sensitive), else 0.0."""
    return 1.0 if normalize_exact(completion) == normalize_exact(reference) else 0.0


def format_reward(task: str, reference: str, completion: str) -> float:
    """1.0 iff the completion states a final answer as ``\\boxed{...}`` (closed, non-blank content), else 0.0.

    This is the convention :func:`math_reward` reads first; ``reference`` is not looked at.
    """
    boxed = extract_boxed(completion)
    return 1.0 if boxed is not None and boxed.strip() else 0.0


# ---------------------------------------------------------------------------------------- reasoning-gym

def _clean(candidate: str, gold: object) -> str:
    text = candidate.strip().strip("*$`").strip()
    if text.endswith(".") and not (isinstance(gold, str) and gold.strip().endswith(".")):
        text = text[:-1].rstrip()
    return text


def _marked(completion: str, multiline: bool) -> str | None:
    tags = _TAG.findall(completion)
    if tags:
        return str(tags[-1])
    markers = list(_ANSWER.finditer(completion))
    if markers:
        rest = completion[markers[-1].end():]
        line = rest.split("\n", 1)[0]
        return rest if multiline or not line.strip("*$` ") else line
    return extract_boxed(completion)


def _last_block(text: str, gold: str) -> str:
    """The last paragraph of ``text`` (after its last blank line), if ``gold`` has no blank line."""
    if _BLANK_LINE.search(gold.strip()):
        return text
    blocks = [b for b in _BLANK_LINE.split(text) if b.strip()]
    return blocks[-1] if blocks else ""


def extract_gym_answer(completion: str, gold: object = None) -> str:
    """The answer to hand to a reasoning-gym ``score_answer``, leniently (small models ignore formats).

    1. a marked answer: the last ``<answer>...</answer>`` (reasoning-gym's convention), else the
       text after the last ``Answer:`` (case-insensitive; to the end of its line, or to the end of
       the completion if that line is empty or the gold answer spans several lines, e.g. a grid),
       else the last ``\\boxed{...}``;
    2. with no mark: for a gold answer of several lines, the completion's last paragraph (after
       its last blank line; the whole completion if the gold itself has a blank line), else the
       completion's last non-empty line;
    3. cleaned: surrounding whitespace, ``*``, ``$`` and backticks removed, and a trailing period
       unless the gold answer ends with one;
    4. if the gold answer is a plain number: the last number in the candidate (in the whole
       completion when unmarked) if the candidate is not itself a number, with thousands
       separators dropped (``1,234`` -> ``1234``).

    One candidate is extracted, never several, so a completion cannot get many guesses scored.
    """
    multiline = isinstance(gold, str) and "\n" in gold.strip()
    marked = _marked(completion, multiline)
    if marked is not None:
        candidate = marked
    elif multiline:
        candidate = _last_block(completion, str(gold))
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        candidate = lines[-1] if lines else ""
    candidate = _clean(candidate, gold)
    if isinstance(gold, str) and _PLAIN_NUMBER.fullmatch(gold.strip()) and not _NUMBER.fullmatch(candidate):
        numbers = _NUMBER.findall(candidate if marked is not None else completion)
        if numbers:
            candidate = numbers[-1]
    if isinstance(gold, str) and _PLAIN_NUMBER.fullmatch(gold.strip()) and _NUMBER.fullmatch(candidate):
        candidate = candidate.replace(",", "")
    return candidate


@lru_cache(maxsize=256)
def _gym_scorer(name: str, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **loads_tagged(config_json))


def reasoning_gym_reward(task: str, reference: str, completion: str) -> float:
    """The score of the reasoning-gym dataset named in ``reference`` for the extracted answer.

    ``reference`` is a :func:`dora_rl.core.prompt_data.gym_reference` JSON (dataset name, config,
    entry); the dataset is rebuilt with that config (cached per worker) because some datasets'
    ``score_answer`` reads its config, and called as ``score_answer(extract_gym_answer(completion,
    entry["answer"]), entry)``. A ``task`` not starting with ``reasoning_gym:`` is not handled
    (:class:`UnknownTaskError`); one naming another dataset than the
    reference raises ValueError.
    """
    if not task.startswith(GYM_PREFIX):
        raise UnknownTaskError(f"reward 'reasoning_gym' scores tasks 'reasoning_gym:<name>', not {task!r}")
    name, config, entry = parse_gym_reference(reference)
    if task != GYM_PREFIX + name:
        raise ValueError(f"task {task!r} does not match the reference's dataset {name!r}")
    scorer = _gym_scorer(name, dumps_tagged(config, sort_keys=True))  # canonical text: a cache key
    return float(scorer.score_answer(extract_gym_answer(completion, entry.get("answer")), entry))
