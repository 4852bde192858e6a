"""The Kafka I/O of a rollout instance that is not its state: its request partition and its engine.

Reads partition ``index`` of ``dora.rollout.requests`` (group ``dora.<run>.rollout-<index>``);
:func:`make_engine` is the one place that knows the engine kinds.
"""

from __future__ import annotations

import numpy as np
from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import is_record
from dora_rl.infra.kafka.io import DeadLetters, consumer_config
from dora_rl.infra.kafka.lag import LagProbe
from dora_rl.infra.kafka.read import consume_ready
from dora_rl.infra.observability import prom
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import RolloutRequest

from .engine import Engine, GenRequest


class RequestReader:
    """Consumer of this instance's request partition with explicit, gap-safe commits."""

    def __init__(self, bootstrap: str, run_id: str, index: int, start: int, dlq: DeadLetters) -> None:
        requests = topics.in_run(run_id, topics.REQUESTS)
        self.tp = TopicPartition(requests, index)
        self.dlq = dlq
        self.run_id = run_id
        self.consumer = Consumer(consumer_config(bootstrap, f"dora.{run_id}.rollout-{index}",
                                                 f"rollout-{index}-{run_id}"))
        have = len(self.consumer.list_topics(requests, timeout=30).topics[requests].partitions)
        if index >= have:
            raise ValueError(f"rollout-{index} has no request partition: {requests} has {have}; an instance "
                             f"index must be below the run's max_instances (the request topic's partitions)")
        committed = self.consumer.committed([self.tp], timeout=30)[0].offset
        self.tp.offset = committed if committed != OFFSET_INVALID and committed >= 0 else start
        self.consumer.assign([self.tp])
        self.lag = LagProbe(f"dora.{run_id}.rollout-{index}")  # recorded after each poll (metrics endpoint)
        prom.watch_consumer(self.consumer, self.lag, bootstrap)
        self.next_offset = self.tp.offset

    def poll(self, timeout: float) -> list[tuple[int, RolloutRequest]]:
        """This run's requests, in offset order: waits at most ``timeout`` for the first, returns when one has come
        (a new request joins the running engine call at once); undecodable ones are dead-lettered."""
        out: list[tuple[int, RolloutRequest]] = []
        msgs = consume_ready(self.consumer, 500, timeout)
        self.lag.record(self.consumer, [self.tp])
        for msg in msgs:
            if not is_record(msg):  # EOF or a retriable error; a security or fatal error raises
                continue
            self.next_offset = (msg.offset() or 0) + 1
            try:
                req = RolloutRequest.decode(msg.value(), msg.headers())
            except DecodeError as exc:
                self.dlq.refuse(msg, str(exc), exc.error_type)
                continue
            if req.run_id == self.run_id:
                out.append((msg.offset() or 0, req))
        return out

    def commit_before(self, offset: int) -> None:
        """Commit: every request below ``offset`` is done."""
        if offset >= 0:
            self.consumer.commit(offsets=[TopicPartition(self.tp.topic, self.tp.partition, offset)],
                                 asynchronous=False)


def make_engine(config: DoraConfig, index: int) -> Engine:
    """The rollout engine of ``config.engine``, with its model and tokenizer loaded (the one place
    that knows the engine kinds). Model engines pin torch to one thread; the emulated one never imports
    torch, so an emulated instance starts in a fraction of the time."""
    from dora_rl.policy_source import resolve_model

    if config.engine == "emulated":
        from dora_rl.core.emulation import EmulatedParams, for_instance

        from .emulated import EmulatedEngine

        params = EmulatedParams.from_dict({"seed": config.seed, **config.emulated})
        return EmulatedEngine(for_instance(params, index), capacity=config.instance_concurrency)
    import torch

    torch.set_num_threads(1)  # one intra-op thread per process: on shared cores more made steps 5x slower
    if config.engine == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine(resolve_model(config.model, config.seed), temperature=config.temperature,
                          seed=config.seed * 1000 + index)
    from dora_rl.modeling import keep_lm_head_fp32, load_policy

    from .torch_engine import TorchEngine

    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
    model, tok = load_policy(resolve_model(config.model, config.seed), dtype=dtype, device=config.device)
    if config.lm_head_fp32:
        keep_lm_head_fp32(model)
    # the run's seed, not the instance's: sampling streams are per request (.sampling), so a request moved
    # with its KV rows continues on any instance exactly as it would have where it started
    return TorchEngine(model, tok, temperature=config.temperature, seed=config.seed,
                       static_cache=config.engine_static_cache)


def gen_request(r: RolloutRequest) -> GenRequest:
    """The engine's request for ``r``; ``kv_moved`` when its partial tokens were all written by its version
    (their KV was computed by the weights it runs under)."""
    versions = r.partial_versions  # None: every partial token is policy_version's (the schema's rule, C1)
    same = len(r.partial_ids) > 0 and (versions is None or (
        len(versions) == len(r.partial_ids) and bool(np.all(versions == r.policy_version))))
    return GenRequest(request_id=r.trajectory_id, prompt_ids=[int(i) for i in r.prompt_ids],
                      partial_ids=[int(i) for i in r.partial_ids],
                      partial_logprobs=[float(x) for x in r.partial_logprobs], max_new_tokens=int(r.max_new_tokens),
                      kv_moved=same)
