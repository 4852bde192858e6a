"""Poison input: how often one request may be tried on an engine before it is refused, as a pure rule.

A request is *tried* once per engine call that holds it (a batch of requests decoded together, or
the request *alone*). A try ends with the request finished, or *failed*: the call **raised**, or the
process **died** during it. A dead process cannot count its own death, so a try is written down
durably *before* the call starts, pessimistically as a death (:meth:`Attempts.started`); a call that
ends is then corrected (finished: forgotten, :meth:`Attempts.finished`; raised: the death becomes a
raise, :meth:`Attempts.raised`). The next incarnation reads the record back and the deaths it holds
are exactly the calls that were running when the process died.

Rule (:func:`verdict`), with ``max_attempts = m``:

- **refuse** once the request has failed ``m`` times *alone*: it is the poison, whatever its batch;
- else run it **alone** once it is a suspect: it was in a call that raised, or in ``2`` calls during
  which the process died (one death is most often not the request's fault: a kill, a lost host, an
  out-of-memory of the whole batch — isolating every request after every kill would serialise the
  instance), so a culprit is isolated instead of refusing its batch-mates;
- else run it in a **batch**.

Bounds: a request that raises is refused after ``1 + m`` failed calls; one that kills the process
after at most ``2 + m`` deaths. Each batch-mate of a culprit runs alone at most once and then
finishes; none is refused for its neighbour. (The supervisor restarts a dead process a bounded
number of times, ``dora_rl.supervisor``, which must exceed ``2 + m`` for a killer request to be
refused rather than end the run.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["batch", "alone", "refuse"]
DEATHS_TO_SUSPECT = 2


@dataclass
class Tries:
    """One request's failed tries: ``died``/``raised`` in any call, ``alone_failed`` of those alone."""

    died: int = 0
    raised: int = 0
    alone_failed: int = 0

    @property
    def failures(self) -> int:
        return self.died + self.raised


def verdict(t: Tries, max_attempts: int) -> Verdict:
    """What to do with a request that has failed ``t`` (see the module docstring)."""
    if t.alone_failed >= max_attempts:
        return "refuse"
    if t.raised >= 1 or t.died >= DEATHS_TO_SUSPECT:
        return "alone"
    return "batch"


class Attempts:
    """The tries of every unfinished request of one rollout instance (serialised durably by the caller
    before each call starts, see the module docstring)."""

    def __init__(self, tries: dict[str, Tries] | None = None) -> None:
        self.tries: dict[str, Tries] = tries or {}

    def of(self, request_id: str) -> Tries:
        return self.tries.get(request_id, Tries())

    def verdict(self, request_id: str, max_attempts: int) -> Verdict:
        return verdict(self.of(request_id), max_attempts)

    def started(self, request_ids: Iterable[str], alone: bool) -> None:
        """A call holding ``request_ids`` starts: count each as died until the call says otherwise."""
        for rid in request_ids:
            t = self.tries.setdefault(rid, Tries())
            t.died += 1
            t.alone_failed += int(alone)

    def not_started(self, request_ids: Iterable[str], alone: bool) -> None:
        """Undo :meth:`started` for requests whose call never took them."""
        for rid in request_ids:
            t = self.tries.get(rid)
            if t is None:
                continue
            t.died = max(0, t.died - 1)
            t.alone_failed = max(0, t.alone_failed - int(alone))
            if t == Tries():
                del self.tries[rid]

    def finished(self, request_id: str) -> None:
        """The request is done (finished, aborted or refused): forget it."""
        self.tries.pop(request_id, None)

    def raised(self, request_ids: Iterable[str]) -> None:
        """The call holding these unfinished requests raised: their last try failed by a raise."""
        for rid in request_ids:
            t = self.tries.setdefault(rid, Tries())
            if t.died > 0:
                t.died -= 1
            t.raised += 1

    def dumps(self) -> bytes:
        return json.dumps({r: [t.died, t.raised, t.alone_failed] for r, t in sorted(self.tries.items())},
                          separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes) -> Attempts:
        return cls({r: Tries(int(v[0]), int(v[1]), int(v[2])) for r, v in json.loads(data).items()})
