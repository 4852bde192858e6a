"""``summary.png``: the curves of a run, written beside its ``summary.json`` when the run ends.

Three panels over the train steps, from the trainer's step metrics on ``dora.metrics`` (read from the
run's start offsets): reward (``reward_mean``, and the summary's held-out pass@1 per version when the
run evaluated), throughput (trained tokens per wall second of each step,
:func:`~dora_rl.consumers.monitor_view.tokens_per_wall_s`, and the run's overall
``throughput_tokens_per_s`` from the summary as a dashed line) and
staleness (``staleness_max`` per step, with the run's ``max_staleness`` as a dashed line). A run with no
step yet gets the same figure with empty panels. :func:`plot_summary` never raises: a run's end must
not fail on its plot (a failure is logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..monitor_view import tokens_per_wall_s

log = logging.getLogger(__name__)
_NAMES = ("reward_mean", "trained_tokens", "staleness_max")


def step_series(metrics: Iterable[Any], run_id: str) -> dict[int, dict[str, float]]:
    """step -> {metric name: value} of the trainer's step metrics of ``run_id`` (first value per step),
    with ``tokens_per_s`` (trained tokens per wall second of the step) where it is known."""
    out: dict[int, dict[str, float]] = {}
    ts: dict[int, int] = {}
    start: int | None = None
    for m in metrics:
        if m.run_id != run_id or m.component != "trainer":
            continue
        if m.name == "version_published" and m.version == 0:
            start = int(m.ts_ms)
        if m.step is not None and m.name in _NAMES:
            out.setdefault(int(m.step), {}).setdefault(m.name, float(m.value))
            if m.name == "reward_mean":
                ts.setdefault(int(m.step), int(m.ts_ms))
    tokens = {k: v["trained_tokens"] for k, v in out.items() if "trained_tokens" in v}
    for k, rate in tokens_per_wall_s(tokens, ts, start).items():
        out[k]["tokens_per_s"] = rate
    return out


def draw(series: Mapping[int, Mapping[str, float]], summary: Mapping[str, Any], paths: Iterable[Path]) -> None:
    """Write the figure of ``series`` to every path in ``paths``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(series)

    def col(name: str) -> tuple[list[int], list[float]]:
        xs = [k for k in steps if name in series[k]]
        return xs, [series[k][name] for k in xs]

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    xs, ys = col("reward_mean")
    axes[0].plot(xs, ys, marker=".", color="tab:blue")
    evals = summary.get("eval") or []
    if evals:  # held-out greedy pass@1 of version v (trained on steps 0..v-1), drawn at x = v
        axes[0].plot([e["version"] for e in evals], [e["pass_at_1"] for e in evals], marker="s", color="tab:green",
                     label="held-out pass@1 (greedy)")
        axes[0].plot([], [], marker=".", color="tab:blue", label="train reward")
        axes[0].legend(loc="lower right")
    axes[0].set_ylabel("reward")
    xs, ys = col("tokens_per_s")
    axes[1].plot(xs, ys, marker=".", color="tab:orange", label="per step")
    if summary.get("throughput_tokens_per_s"):
        axes[1].axhline(float(summary["throughput_tokens_per_s"]), ls="--", color="gray", label="run")
        axes[1].legend(loc="lower right")
    axes[1].set_ylabel("trained tokens/s")
    xs, ys = col("staleness_max")
    axes[2].step(xs, ys, where="mid", color="tab:red", label="max per step")
    bound = (summary.get("config") or {}).get("max_staleness")
    if bound is not None:
        axes[2].axhline(float(bound), ls="--", color="gray", label="max_staleness")
        axes[2].legend(loc="lower right")
    axes[2].set_ylabel("staleness")
    axes[2].set_xlabel("train step")
    fig.suptitle(f"run {summary.get('run_id', '?')} ({summary.get('mode', '?')}): {len(steps)} steps"
                 + (f", failed: {summary['failed']}"[:90] if summary.get("failed") else ""))
    fig.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_summary(bootstrap: str, summary: Mapping[str, Any], run_dir: Path, json_path: Path | None = None
                 ) -> list[Path]:
    """``<run_dir>/summary.png`` (and ``<json_path>.png`` beside ``--json``) of the run in ``summary``;
    returns the paths written (none on failure, which is logged)."""
    paths = [run_dir / "summary.png"] + ([json_path.with_suffix(".png")] if json_path is not None else [])
    try:
        from dora_rl.infra.kafka import topics
        from dora_rl.infra.kafka.runs import get_run, read_run
        from dora_rl.schemas.codec import DecodeError
        from dora_rl.schemas.records import Metric

        run_id = str(summary["run_id"])
        info = get_run(bootstrap, run_id)
        records = []
        for msg in read_run(bootstrap, info, topics.METRICS):
            try:
                records.append(Metric.decode(msg.value(), msg.headers()))
            except DecodeError:
                continue
        draw(step_series(records, run_id), summary, paths)
        return paths
    except Exception:
        log.exception("the run's plot (%s) was not written", paths[0])
        return []


__all__ = ["draw", "plot_summary", "step_series"]
