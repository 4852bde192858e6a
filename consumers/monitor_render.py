"""Text rendering of a :class:`~.monitor_view.RunSnapshot` for ``dora-rl monitor`` (pure, no I/O).

:func:`render` returns the lines of one frame; :func:`frame` wraps them in ANSI so that a terminal
redraws the frame in place (cursor home, each line cleared to its end, the rest of the screen cleared).
Bars are ``█`` scaled to the largest value shown; nothing depends on the terminal's width beyond ``width``.
"""

from __future__ import annotations

from .monitor_view import RunSnapshot, StepRow

HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def bar(value: float, top: float, width: int) -> str:
    """``value`` as a bar of at most ``width`` blocks, ``top`` being full width."""
    return "█" * (round(width * value / top) if top > 0 else 0)


def step_line(row: StepRow) -> str:
    """One step as the non-follow monitor prints it."""
    return (f"step {row.step:4d}  reward {_num(row.reward)}  tokens {row.trained_tokens:7.0f}  "
            f"staleness<= {_num(row.staleness_max, '.0f')}  update {_num(row.train_s, '.2f')}s  "
            f"waited {_num(row.wait_s, '.2f')}s")


def render(s: RunSnapshot, width: int = 100, steps_shown: int = 8) -> list[str]:
    """The lines of one monitor frame."""
    done = f"{s.step_count}/{s.steps_target}" if s.steps_target else str(s.step_count)
    lines = [f"run {s.run_id}  mode {s.mode}  S={s.max_staleness}  {s.state}{'  DONE' if s.done else ''}  "
             f"steps {done}  version {s.latest_version}",
             f"reward {_num(s.reward)}   throughput {_num(s.throughput_tokens_per_s, '.0f')} trained tok/s   "
             f"dead letters {s.dlq_total} ({s.dlq_per_min:.0f}/min)", ""]
    lines.append("versions live      pending  in-flight  instances")
    lines += [f"  v{v.version:<6d}        {v.pending:7d}  {v.in_flight:9d}  {', '.join(v.instances) or '-'}"
              for v in s.versions] or ["  none"]
    lines += ["", "instances          version  state     in-flight  tokens/s  idle"]
    lines += [f"  {i.instance_id:16s} v{i.version:<6d} {i.state:8s} {i.in_flight:4d}/{i.capacity:<4d} "
              f"{_num(i.tokens_per_s, '9.0f')}  {i.idle_fraction:4.0%}" for i in s.instances] or ["  none"]
    lines += ["", f"staleness of the last {s.recent_batches} batches (trajectories)"]
    top = max((n for _, n in s.staleness_recent), default=0)
    lines += [f"  {k:3d} {n:7d} {bar(n, top, max(10, width - 20))}" for k, n in s.staleness_recent] or ["  none"]
    lines += ["", "consumer lag        topic                        partitions   lag"]
    lines += [f"  {r.role:16s} {r.topic:28s} {r.partitions:10d} {r.lag:5d}" for r in s.lag] \
        or ["  none (no committed offsets yet)"]
    if s.dlq_by_reason:
        lines += ["", "dead letters: " + ", ".join(f"{k}={n}" for k, n in s.dlq_by_reason)]
    lines += ["", "recent steps (reward, trained tok/s, staleness max/mean)"]
    for r in s.steps[-steps_shown:]:
        lines.append(f"  step {r.step:4d}  reward {_num(r.reward)}  {_num(r.tokens_per_s, '8.0f')} tok/s  "
                     f"staleness {_num(r.staleness_max, '.0f')}/{_num(r.staleness_mean, '.2f')}")
    if s.endpoints:
        lines += ["", "metrics endpoints: " + ", ".join(f"{n}={a}" for n, a in s.endpoints)]
    return [line[:width] for line in lines]


def frame(lines: list[str]) -> str:
    """``lines`` drawn in place on an ANSI terminal."""
    return HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW


__all__ = ["bar", "frame", "render", "step_line"]
