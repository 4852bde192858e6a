"""Which scheduling rules a mode runs: the one place that knows every mode's rules class.

``make_scheduler`` lives here, above :mod:`.scheduling` (the interface and the wave rules), :mod:`.dora_rules` and
:mod:`.partial_policy` (each mode's version rules over :mod:`.dora_policy`), so none of them imports another back.
"""

from __future__ import annotations

from typing import Any

from dora_rl.config import DoraConfig

from .dora_rules import dora_scheduler
from .partial_policy import partial_scheduler
from .scheduling import Scheduler, SchedulingRules


def make_scheduler(config: DoraConfig) -> SchedulingRules[Any]:
    """The scheduling rules of ``config.mode``."""
    if config.mode == "dora":
        return dora_scheduler(config)
    if config.mixes_versions:
        return partial_scheduler(config)
    return Scheduler(config)
