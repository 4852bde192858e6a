"""TensorBoard event files of a run: every metric on ``dora.metrics``, as the launcher reads it.

Written by ``dora-rl run`` (the launcher's watcher feeds :meth:`TensorBoardLog.observe` with each
:class:`~dora_rl.schemas.records.Metric` of the run as it arrives) into ``<run dir>/tensorboard``;
read by ``tensorboard --logdir <run dir>/tensorboard``.

Mapping: tag ``<component>/<name>`` (``trainer/reward_mean``, ``trainer/eval_pass_at_1``, ...); the
x-axis is the metric's train ``step`` when it has one, else its policy ``version``, else the count of
earlier points of that tag; the wall time is the metric's own ``ts_ms`` (so a restarted launcher's
re-read of the log plots the same curve). A metric of one rollout instance gets the instance in its
tag (``rollout/tokens_per_s/rollout-0``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dora_rl.schemas.records import Metric


class TensorBoardLog:
    """Appends the metrics of one run to TensorBoard event files under ``logdir``."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer: Any = SummaryWriter(log_dir=str(self.logdir))
        self._counts: dict[str, int] = {}

    def observe(self, metric: Metric) -> None:
        """Add one point (see the module docstring for the tag and the x-axis)."""
        tag = f"{metric.component}/{metric.name}"
        instance = metric.labels.get("instance")
        if instance:
            tag = f"{tag}/{instance}"
        if metric.step is not None:
            x = int(metric.step)
        elif metric.version is not None:
            x = int(metric.version)
        else:
            x = self._counts.get(tag, 0)
        self._counts[tag] = self._counts.get(tag, 0) + 1
        self._writer.add_scalar(tag, float(metric.value), global_step=x, walltime=metric.ts_ms / 1000.0)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.flush()
        self._writer.close()
