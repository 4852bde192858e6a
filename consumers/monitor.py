"""Stream monitoring: a run's progress from ``dora.metrics``, ``dora.instances`` and ``dora.dlq``.

Prints one line per training step (reward, tokens, staleness, update time) and a status block:
instances with their loaded version, state and tokens, dead letters by reason. ``follow`` keeps
tailing until interrupted; otherwise it prints what is recorded now and returns.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, RecordProducer, RunConsumer, now_ms
from dora_rl.infra.runs import get_run, offsets_map
from dora_rl.schemas.records import DeadLetter, InstanceStatus, Metric


class RunView:
    """Accumulates a run's monitoring records."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.instances: dict[str, InstanceStatus] = {}
        self.dead: Counter[str] = Counter()
        self.printed = 0

    def observe(self, topic: str, record: Any) -> None:
        if topic == topics.METRICS and record.component == "trainer" and record.step is not None:
            self.steps.setdefault(int(record.step), {})[record.name] = record.value
        elif topic == topics.INSTANCES:
            self.instances[record.instance_id] = record
        elif topic == topics.DLQ:
            self.dead[f"{record.component}:{record.error_type}"] += 1

    def new_lines(self) -> list[str]:
        lines = []
        for step in sorted(s for s in self.steps if s >= self.printed):
            m = self.steps[step]
            if "reward_mean" not in m or "train_s" not in m:
                break
            lines.append(f"step {step:4d}  reward {m['reward_mean']:.3f}  tokens {m.get('trained_tokens', 0):7.0f}  "
                         f"staleness<= {m.get('staleness_max', 0):.0f}  update {m['train_s']:.2f}s  "
                         f"waited {m.get('wait_s', 0):.2f}s")
            self.printed = step + 1
        return lines

    def status(self) -> str:
        rows = [f"  {i.instance_id:12s} v{i.loaded_version:<4d} {i.state:8s} in-flight {i.in_flight:4d} "
                f"tokens {i.generated_tokens}" for i in sorted(self.instances.values(), key=lambda x: x.instance_id)]
        dlq = ", ".join(f"{k}={v}" for k, v in self.dead.items()) or "none"
        return "instances:\n" + ("\n".join(rows) or "  none") + f"\ndead letters: {dlq}"


def monitor(bootstrap: str, run_id: str | None, follow: bool = False, idle_s: float = 3.0) -> RunView:
    """Print a run's progress; returns the accumulated view."""
    info = get_run(bootstrap, run_id)
    producer = RecordProducer(bootstrap, "monitor")
    consumer = RunConsumer(bootstrap, info.run_id, "monitor",
                           {topics.METRICS: Metric, topics.INSTANCES: InstanceStatus, topics.DLQ: DeadLetter},
                           DeadLetters(producer, "monitor", info.run_id), offsets_map(info),
                           group_suffix=f".{now_ms()}")
    view = RunView()
    print(f"run {info.run_id} ({info.mode}, {info.state})")
    last = time.monotonic()
    try:
        while True:
            envs = consumer.poll(0.5)
            for env in envs:
                view.observe(env.topic, env.record)
            for line in view.new_lines():
                print(line, flush=True)
            if envs:
                last = time.monotonic()
            elif not follow and time.monotonic() - last > idle_s:
                break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    print(view.status())
    return view
