"""Which scheduling rules a mode runs: the one place that knows every mode's rules class.

``make_scheduler`` lives here, above :mod:`.scheduling` (the interface and the wave rules), :mod:`.dora_policy`
and :mod:`.partial_policy` (which build on the interface), so none of them imports another back.
"""

from __future__ import annotations

from typing import Any

from dora_rl.config import DoraConfig

from .dora_policy import DoraScheduler
from .partial_policy import partial_scheduler
from .scheduling import Scheduler, SchedulingRules


def make_scheduler(config: DoraConfig) -> SchedulingRules[Any]:
    """The scheduling rules of ``config.mode``."""
    if config.mode == "dora":
        return DoraScheduler(config)
    if config.mixes_versions:
        return partial_scheduler(config)
    return Scheduler(config)
