"""``dora-rl monitor``: a run's progress from its topics (the view model is :mod:`.monitor_view`).

Without ``follow``: prints one line per training step (reward, tokens, staleness, update time) and a
status frame, reading what is recorded now, and returns once nothing new arrived for ``idle_s``.

With ``follow``: a live frame (:func:`.monitor_render.render`) redrawn in place every ``refresh_s`` on a
terminal (printed whole, at most every 5 s, when the output is not a terminal) until interrupted:
versions live and their pending work, instances (version, state, in-flight, tokens/s, idle share),
the staleness histogram of the recent batches, consumer lag per role (committed offsets of the run's
groups), dead letters and their rate, throughput and reward.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from dora_rl.infra.kafka.io import now_ms

from .monitor_feed import RunFeed
from .monitor_render import frame, render, step_line
from .monitor_view import RunView


def monitor(bootstrap: str, run_id: str | None, follow: bool = False, idle_s: float = 3.0,
            refresh_s: float = 1.0, out: TextIO | None = None, width: int = 110) -> RunView:
    """Print a run's progress; returns the accumulated view."""
    out = out or sys.stdout
    feed = RunFeed(bootstrap, run_id, lag_every_s=5.0 if follow else 0.0)
    view = feed.view
    live = follow and out.isatty()
    if not follow:
        print(f"run {view.run_id} ({view.mode}, {view.state})", file=out)
    printed, last_data, last_draw = 0, time.monotonic(), 0.0
    try:
        while True:
            if feed.poll(0.5):
                last_data = time.monotonic()
            elif not follow and time.monotonic() - last_data > idle_s:
                break
            if not follow:
                for row in (r for r in view.step_rows() if r.step >= printed):
                    if row.reward is None or row.train_s is None:
                        break  # in step order: the next line waits for this step's figures
                    print(step_line(row), file=out, flush=True)
                    printed = row.step + 1
            elif time.monotonic() - last_draw >= (refresh_s if live else 5.0):
                lines = render(view.snapshot(now_ms()), width)
                out.write(frame(lines) if live else "\n".join(lines) + "\n\n")
                out.flush()
                last_draw = time.monotonic()
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()
    if not follow:
        feed.refresh()
        print("\n".join(render(view.snapshot(now_ms()), width)), file=out)
    return view
